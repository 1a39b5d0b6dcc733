"""Regional compilation: a model's repeated blocks through one torch.compile'd function each, so
that identical layers share a graph and compile once, instead of compiling the whole model.

Two users: the frozen target's decoder layers (extract, ``dflash-pipe plan``, the benchmarks) and
the drafter's layers (the trainer, the benchmarks), whose compile also loads the portable compile
cache (``compile_cache``) when one is configured.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_model.fast import compile_cache


def compile_blocks(layers: Sequence[nn.Module]) -> None:
    """Send every block's ``forward`` through one torch.compile'd function (Inductor fuses the
    norms, RoPE, SwiGLU and residual adds that HF runs as separate kernels; blocks of one kind
    share a graph). Only ``forward`` is replaced, so forward hooks, which run in the module call
    around it, stay outside the graph and can come and go without recompiling. For fixed-length
    rows (extract); a forward whose length changes every call (decoding with a KV cache) would
    recompile."""
    compiled = torch.compile(type(layers[0]).forward, dynamic=False)
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)


@dataclass(frozen=True)
class DrafterCompile:
    """What :func:`compile_drafter` did."""

    compiled: bool
    """The draft layers go through torch.compile (the loss follows this flag too)."""
    cache_url: str | None
    """Where to save the compiled kernels once the first step has compiled everything; None
    without a cache, or when the cache was loaded (nothing new to save)."""
    cache_loaded: bool


def compile_drafter(model: Any, wanted: bool, device: torch.device, cache_root: str | None,
                    logger: logging.Logger | Any, **options: Any) -> DrafterCompile:
    """Compile the drafter's layers if ``wanted`` (``settings.compile_wanted`` of the run's
    ``compile`` setting on ``device``), and pre-load the compile cache under ``cache_root`` (a path
    or URL; None = no cache) before the first step. ``options`` go to
    ``DFlashDrafter.compile_layers``. Call it once the drafter is on its device with its flex
    attention settings chosen: the compile reads both."""
    if not wanted:
        return DrafterCompile(compiled=False, cache_url=None, cache_loaded=False)
    model.compile_layers(**options)
    if not cache_root:
        return DrafterCompile(compiled=True, cache_url=None, cache_loaded=False)
    url = compile_cache.cache_url(str(cache_root), device)
    loaded = compile_cache.load(url, logger)
    return DrafterCompile(compiled=True, cache_url=None if loaded else url, cache_loaded=loaded)
