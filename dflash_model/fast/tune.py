"""The one way into the fast paths for a drafter: its flex attention settings, then its compile.

The order matters and is kept here: a tile below flex attention's own installs an Inductor hook,
process-wide, that must be in place before the first compile, and the compile reads the model's
flex settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflash_model.fast import compile_cache
from dflash_model.fast.flex import tune_flex

if TYPE_CHECKING:
    from dflash_model.drafter.model import DFlashDrafter


@dataclass(frozen=True)
class TunedDrafter:
    """What :func:`tune_drafter` did to a drafter."""

    model: DFlashDrafter
    compiled: bool
    """The draft layers go through torch.compile (the loss follows this flag too)."""
    cache_url: str | None
    """Where to save the compiled kernels once the first step has compiled everything; None
    without a cache, or when the cache was loaded (nothing new to save)."""
    cache_loaded: bool


def tune_drafter(model: DFlashDrafter, device: torch.device, dtype: torch.dtype, *,
                 kernel_options: Any = "auto", tile: int | str = "auto", compile: bool = False,
                 cache_root: str | None = None, logger: logging.Logger | Any = None,
                 compile_options: dict[str, Any] | None = None) -> TunedDrafter:
    """Tune a drafter already on ``device`` in ``dtype``: choose its flex kernel options and tile
    (``flex.tune_flex``), then, if ``compile``, compile its layers and load the compile cache under
    ``cache_root`` (a path or URL; None = no cache). ``compile_options`` go to
    ``DFlashDrafter.compile_layers``. Speed only: results are the same beyond rounding."""
    tune_flex(model, device, dtype, kernel_options=kernel_options, tile=tile)
    if not compile:
        return TunedDrafter(model=model, compiled=False, cache_url=None, cache_loaded=False)
    model.compile_layers(**(compile_options or {}))
    if not cache_root:
        return TunedDrafter(model=model, compiled=True, cache_url=None, cache_loaded=False)
    url = compile_cache.cache_url(str(cache_root), device)
    loaded = compile_cache.load(url, logger or logging.getLogger(__name__))
    return TunedDrafter(model=model, compiled=True, cache_url=None if loaded else url, cache_loaded=loaded)
