"""Attention over [context ; blocks] with the training mask: flex_attention or SDPA, one mask rule.

``attn_backend``: "flex" (flex_attention + BlockMask; compiled on CUDA, eager on CPU where it has
no backward), "sdpa" (dense boolean mask from the same mask function), "auto" = flex on CUDA,
sdpa otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from dflash_model.drafter.mask import TILE

BACKENDS = ("auto", "flex", "sdpa")


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto -> flex on CUDA, sdpa elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


# flex_attention kernel options measured fastest at the drafter's training mask by
# benchmarks/flex_tune.py (H200, Qwen3-8B heads: 32 query / 8 KV heads of 128, 8,192 queries over
# 16,384 keys): forward 0.86 vs 1.09 ms, backward 2.83 vs 2.95 ms per layer against torch's sm90
# defaults (forward 128x64, 3 stages, 8 warps; backward 64/128/128/64, 3 stages, 8 warps).
# Keyed by (compute capability, head dim, dtype); elsewhere torch's defaults stand.
TUNED_FLEX_OPTIONS: dict[tuple[tuple[int, int], int, torch.dtype], dict[str, int]] = {
    ((9, 0), 128, torch.bfloat16): {
        "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3, "bwd_num_warps": 4,
    },
}


def flex_kernel_options(setting: Any, device: torch.device, head_dim: int,
                        dtype: torch.dtype) -> dict[str, Any] | None:
    """``auto`` -> the measured options for this GPU, head dim and dtype if any (else None:
    torch's defaults); a dict is used as given; None/{} -> torch's defaults."""
    if setting != "auto":
        return dict(setting) if setting else None
    if device.type != "cuda":
        return None
    opts = TUNED_FLEX_OPTIONS.get((torch.cuda.get_device_capability(device), head_dim, dtype))
    return dict(opts) if opts else None


# The BlockMask tile (mask.TILE unless listed) at which the options above run fastest. At the
# training mask 64-tiles compute 8.5% fewer (query, key) pairs than 128-tiles (a tile cut by a
# document or anchor boundary is computed whole): forward 0.99 -> 0.78 ms, backward 2.59 -> 2.39 ms
# per layer; the step 1.4-1.8 ms shorter on three H200s (docs/benchmarks.md, session 10).
TUNED_FLEX_TILE: dict[tuple[tuple[int, int], int, torch.dtype], int] = {((9, 0), 128, torch.bfloat16): 64}


def flex_tile(setting: int | str, device: torch.device, head_dim: int, dtype: torch.dtype,
              options: dict[str, Any] | None) -> int:
    """The BlockMask tile for flex attention: ``auto`` -> this GPU's entry in ``TUNED_FLEX_TILE``
    where the kernel ``options`` fit it and torch lets us offer its backward a kernel for it
    (``allow_flex_tile``), else ``mask.TILE``; an int is used as given. A tile other than
    ``mask.TILE`` installs ``allow_flex_tile``, so call this before the first compile."""
    if setting == "auto":
        tile = TILE
        if device.type == "cuda" and _tile_hook_problem() is None:
            tuned = TUNED_FLEX_TILE.get((torch.cuda.get_device_capability(device), head_dim, dtype), TILE)
            tile = tuned if not _misfits(options, tuned) else TILE
    else:
        tile = int(setting)
        if bad := _misfits(options, tile):
            raise ValueError(f"flex_kernel_options block sizes {bad} do not divide flex_tile {tile}")
    if tile != TILE:
        allow_flex_tile(tile)
    return tile


def _misfits(options: dict[str, Any] | None, tile: int) -> dict[str, int]:
    """The kernel block sizes in ``options`` that do not divide ``tile`` (flex requires they do)."""
    return {k: v for k, v in (options or {}).items() if "BLOCK" in k and tile % v}


def _tile_hook_problem() -> str | None:
    """Why ``allow_flex_tile`` cannot work in this process, or None."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices

    if not hasattr(config, "inductor_choices_class") or not hasattr(InductorChoices,
                                                                     "get_flex_attention_bwd_configs"):
        return f"torch {torch.__version__} has no replaceable flex backward configs"
    current = config.inductor_choices_class
    if current is not None and getattr(current, "func", None) is not _tile_choices:
        return f"Inductor's choices are already replaced ({current!r}); not overriding them"
    return None


def allow_flex_tile(tile: int) -> None:
    """Let flex attention's backward compile for BlockMask tiles of ``tile`` (process-wide).

    Why: Inductor's flex backward keeps only those of its default block-size configs that divide
    the BlockMask's tile, and applies ``kernel_options`` after that; on sm90 with head dim 128 its
    one default is (64, 128, 128, 64), so a 64-tile had no kernel left (NoValidChoicesError) even
    where the kernel options asked for blocks that fit. Inductor reads its heuristics from a
    replaceable ``InductorChoices`` (``config.inductor_choices_class``, a factory each compiling
    thread calls once, the autograd thread included): ours caps the default block sizes at the
    tile, so that the kernel options decide. The calling thread's choices are replaced at once,
    in case it compiled something before; other threads must not have compiled a backward yet."""
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
def _flex_fn(compiled: bool) -> Any:
    """flex_attention, compiled once per process (a fused kernel with backward on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, backend: str,
           kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """q [Q, nh, d], k/v [KV, nkv, d] -> [Q, nh, d].

    ``mask`` is a BlockMask for "flex" or a [Q, KV] bool tensor (True = attend) for "sdpa";
    ``kernel_options`` go to flex_attention (its Triton block sizes), unused by SDPA.
    """
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if backend == "flex":
        # inside a compiled region (compiled draft layers) the plain function is traced in place
        compiled = q.device.type == "cuda" and not torch.compiler.is_compiling()
        out = _flex_fn(compiled)(qh, kh, vh, block_mask=mask, enable_gqa=kh.shape[1] != qh.shape[1],
                                 kernel_options=kernel_options)
    else:
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:  # explicit GQA expansion keeps SDPA on its masked fused kernels on every torch version
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out.squeeze(0).transpose(0, 1)
