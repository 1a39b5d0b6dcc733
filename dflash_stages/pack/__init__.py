"""The pack stages: best-fit packing of samples into rows (``packing`` is numpy only), random rows."""
