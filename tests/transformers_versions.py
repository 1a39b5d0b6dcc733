"""The marks for tests of hybrid (linear-attention) targets: those need a newer transformers than the
rest of dflash-pipe (``compat.HYBRID``), so under an older one they skip, and
``tests/target/test_transformers_versions.py`` checks the error such a target gets there instead;
and a hybrid's forward on the CPU cannot run where flash-linear-attention is installed."""

from __future__ import annotations

import pytest

from dflash_model.target import compat
from dflash_model.target.linear_attention import fla_kernels

needs_hybrid = pytest.mark.skipif(not compat.installed_at_least(compat.HYBRID),
                                  reason=f"hybrid (linear-attention) targets need transformers>={compat.HYBRID}")

hybrid_on_cpu = pytest.mark.skipif(fla_kernels() is not None, reason="with fla installed, transformers runs "
                                   "the layers' own forward on fla's kernels, which need CUDA")
