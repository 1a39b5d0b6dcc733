"""Speed: Triton kernels, the optimizer's kernel choice, the compile gate and cache, flex tuning.

``tune_drafter`` (from ``tune``) is the one entry point that makes a drafter fast: its flex
attention settings, then its compile and compile cache. It is imported on first use so that
``dflash_model.fast.settings`` stays importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tune_drafter"]


def __getattr__(name: str) -> Any:
    if name == "tune_drafter":
        from dflash_model.fast.tune import tune_drafter

        return tune_drafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
