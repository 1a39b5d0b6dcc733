"""Speed of flex attention: the kernel options and BlockMask tile for a GPU kind, the Inductor hook
a small tile needs, and the compiled flex function.

Choosing is pure (``choose_kernel_options``, ``choose_tile``: they read, never change, process
state). The one thing that changes process-wide Inductor state, the tile hook, is installed only by
``tune_flex``, the flex part of the entry point ``dflash_model.fast.tune_drafter``, which runs it
before anything compiles. The attention math itself is in ``dflash_model/drafter/attention.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


# flex_attention's own BlockMask tile, both ways: every kernel it has fits it, so it needs no hook.
# Smaller tiles compute less of the ragged tiles at the training mask (see ``TUNED_FLEX_TILE``).
TILE = 128

_Key = tuple[tuple[int, int], int, torch.dtype]  # (compute capability, head dim, dtype)

# Kernel options that benchmarks/flex_tune.py measured faster than torch's defaults at the drafter's
# training mask (figures in docs/benchmarks.md). Elsewhere torch's defaults stand.
TUNED_FLEX_OPTIONS: dict[_Key, dict[str, int]] = {
    ((9, 0), 128, torch.bfloat16): {
        "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3, "bwd_num_warps": 4,
    },
}

# The BlockMask tile (``TILE`` unless listed) at which the options above run fastest: a tile cut by
# a document or anchor boundary is computed whole, so smaller tiles compute fewer masked-out pairs.
TUNED_FLEX_TILE: dict[_Key, int] = {((9, 0), 128, torch.bfloat16): 64}


def tune_flex(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *,
              kernel_options: Any = "auto", tile: int | str = "auto") -> torch.nn.Module:
    """Set ``model.flex_kernel_options`` and ``model.flex_tile`` for ``device`` and ``dtype``;
    returns the model.

    ``kernel_options``: "auto" (``TUNED_FLEX_OPTIONS``), a mapping, or None/{} (torch's defaults);
    ``tile``: "auto" (``TUNED_FLEX_TILE`` where the options fit it) or 16/32/64/128. A tile below
    ``TILE`` installs the Inductor hook its backward needs, process-wide: call this before the
    first compile. Speed only: results are the same beyond rounding.
    """
    head_dim = model.config.head_dim
    options = choose_kernel_options(kernel_options, device, head_dim, dtype)
    chosen = choose_tile(tile, device, head_dim, dtype, options)
    if chosen != TILE:
        _allow_flex_tile(chosen)
    model.flex_kernel_options = options
    model.flex_tile = chosen
    return model


def choose_kernel_options(setting: Any, device: torch.device, head_dim: int,
                          dtype: torch.dtype) -> dict[str, Any] | None:
    """``auto`` -> the tuned options for this GPU, head dim and dtype if any (else None: torch's
    defaults); a mapping is used as given (copied); None/{} -> torch's defaults."""
    if setting != "auto":
        return dict(setting) if setting else None
    if device.type != "cuda":
        return None
    opts = TUNED_FLEX_OPTIONS.get((torch.cuda.get_device_capability(device), head_dim, dtype))
    return dict(opts) if opts else None


def choose_tile(setting: int | str, device: torch.device, head_dim: int, dtype: torch.dtype,
                options: dict[str, Any] | None) -> int:
    """The BlockMask tile: ``auto`` -> this GPU's entry in ``TUNED_FLEX_TILE`` where the kernel
    ``options`` fit it and the tile hook can be installed in this process, else ``TILE``; an int
    is used as given, checked against ``options``. Changes nothing (``tune_drafter`` installs)."""
    if setting == "auto":
        tile = TILE
        if device.type == "cuda" and _tile_hook_problem() is None:
            tuned = TUNED_FLEX_TILE.get((torch.cuda.get_device_capability(device), head_dim, dtype), TILE)
            tile = tuned if not _misfits(options, tuned) else TILE
        return tile
    tile = int(setting)
    if bad := _misfits(options, tile):
        raise ValueError(f"flex_kernel_options block sizes {bad} do not divide flex_tile {tile}")
    return tile


def _misfits(options: dict[str, Any] | None, tile: int) -> dict[str, int]:
    """The kernel block sizes in ``options`` that do not divide ``tile`` (flex requires they do)."""
    return {k: v for k, v in (options or {}).items() if "BLOCK" in k and tile % v}


def _tile_hook_problem() -> str | None:
    """Why the tile hook cannot be installed in this process, or None."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices

    if not hasattr(config, "inductor_choices_class") or not hasattr(InductorChoices,
                                                                     "get_flex_attention_bwd_configs"):
        return f"torch {torch.__version__} has no replaceable flex backward configs"
    current = config.inductor_choices_class
    if current is not None and getattr(current, "func", None) is not _tile_choices:
        return f"Inductor's choices are already replaced ({current!r}); not overriding them"
    return None


def _allow_flex_tile(tile: int) -> None:
    """Let flex attention's backward compile for BlockMask tiles of ``tile`` (process-wide; only
    ``tune_drafter`` calls this).

    Why: Inductor's flex backward keeps only those of its default block-size configs that divide
    the BlockMask's tile, and applies ``kernel_options`` after that; where its defaults are larger
    than the tile no kernel is left (NoValidChoicesError) even when the kernel options ask for
    blocks that fit (on sm90, head dim 128, its one default is 64/128/128/64: none for 64-tiles).
    Inductor reads its heuristics from a replaceable ``InductorChoices``
    (``config.inductor_choices_class``, a factory each compiling thread calls once, the autograd
    thread included): ours caps the default block sizes at the tile, so that the kernel options
    decide. The calling thread's choices are replaced at once, in case it compiled something
    before; other threads must not have compiled a backward yet."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if problem := _tile_hook_problem():
        raise RuntimeError(f"flex tile {tile}: {problem}")
    config.inductor_choices_class = functools.partial(_tile_choices, tile)
    V.set_choices_handler(config.inductor_choices_class())


def _tile_choices(tile: int) -> Any:
    """An ``InductorChoices`` whose flex backward configs fit BlockMask tiles of ``tile``."""
    from torch._inductor.choices import InductorChoices

    class TileChoices(InductorChoices):
        def get_flex_attention_bwd_configs(self, head_dim: int, dtype: torch.dtype,
                                           device_type: str | None = "cuda") -> list[Any]:
            return [dataclasses.replace(c, **{f: min(getattr(c, f), tile)
                                              for f in ("block_m1", "block_n1", "block_m2", "block_n2")})
                    for c in super().get_flex_attention_bwd_configs(head_dim, dtype, device_type)]

        def uuid(self) -> str:  # Inductor's cache keys name a replaced choices class by this
            return f"dflash-flex-tile-{tile}"

    return TileChoices()


@functools.lru_cache(maxsize=None)
def flex_attention_fn(compiled: bool) -> Any:
    """flex_attention, compiled once per process when ``compiled`` (a fused kernel with backward
    on CUDA), else the plain function (eager on CPU; traced in place inside a compiled region)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_model.fast.compile_gate import compiled as compile_fn

    return compile_fn(flex_attention) if compiled else flex_attention
