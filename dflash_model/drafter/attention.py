"""Attention over [context ; blocks] with the training mask: flex_attention or SDPA, one mask rule.

``attn_backend``: "flex" (flex_attention + BlockMask; compiled on CUDA, eager on CPU where it has
no backward), "sdpa" (dense boolean mask from the same mask function: the CPU fallback), "auto" =
flex on CUDA, sdpa otherwise. How flex is tuned (kernel options, tile) is dflash_model/fast/flex.py.
"""

from __future__ import annotations

from typing import Any, get_args

import torch
import torch.nn.functional as F

from dflash_model.drafter.mask import GatheredKeys
from dflash_model.fast.flex import flex_attention_fn
from dflash_model.fast.settings import AttnBackend

BACKENDS = get_args(AttnBackend)


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto -> flex on CUDA, sdpa elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, backend: str,
           kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """q [Q, nh, d], k/v [KV, nkv, d] -> [Q, nh, d].

    ``mask`` is a BlockMask for "flex"; for "sdpa" a [Q, KV] bool tensor (True = attend) or the
    same mask as ``GatheredKeys`` (mask.py), whose blocks are scored against their own keys only;
    ``kernel_options`` go to flex_attention (its Triton block sizes), unused by SDPA.
    """
    if isinstance(mask, GatheredKeys):  # SDPA on each block's own keys: [N, heads, B, K]
        n = mask.index.shape[0]
        qh = q.view(n, -1, *q.shape[1:]).transpose(1, 2)
        kh, vh = (t[mask.index].transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(qh, *_gqa(qh, kh, vh), attn_mask=mask.allowed[:, None])
        return out.transpose(1, 2).reshape(q.shape)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if backend == "flex":
        # inside a compiled region (compiled draft layers) the plain function is traced in place
        compiled = q.device.type == "cuda" and not torch.compiler.is_compiling()
        out = flex_attention_fn(compiled)(qh, kh, vh, block_mask=mask, enable_gqa=kh.shape[1] != qh.shape[1],
                                          kernel_options=kernel_options)
    else:
        out = F.scaled_dot_product_attention(qh, *_gqa(qh, kh, vh), attn_mask=mask)
    return out.squeeze(0).transpose(0, 1)


def _gqa(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with each head repeated for its query heads: an explicit GQA expansion keeps SDPA on
    its masked fused kernels on every torch version."""
    rep = qh.shape[1] // kh.shape[1]
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    return kh, vh
