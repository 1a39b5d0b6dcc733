"""The mark for tests of hybrid (linear-attention) targets: those need a newer transformers than the
rest of dflash-pipe (``compat.HYBRID``), so under an older one they skip, and
``tests/target/test_transformers_versions.py`` checks the error such a target gets there instead."""

from __future__ import annotations

import pytest

from dflash_model.target import compat

needs_hybrid = pytest.mark.skipif(not compat.installed_at_least(compat.HYBRID),
                                  reason=f"hybrid (linear-attention) targets need transformers>={compat.HYBRID}")
