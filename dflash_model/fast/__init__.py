"""Speed: Triton kernels, the optimizer's kernel choice, the compile gate and cache, flex tuning.

``tune_drafter`` (from ``flex``) is the one entry point that tunes a drafter's flex attention;
it is imported on first use so that ``dflash_model.fast.settings`` stays importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tune_drafter"]


def __getattr__(name: str) -> Any:
    if name == "tune_drafter":
        from dflash_model.fast.flex import tune_drafter

        return tune_drafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
