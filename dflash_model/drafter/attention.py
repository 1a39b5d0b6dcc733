"""Attention over [context ; blocks] with the training mask: flex_attention or SDPA, one mask rule.

``attn_backend``: "flex" (flex_attention + BlockMask; compiled on CUDA, eager on CPU where it has
no backward), "sdpa" (dense boolean mask from the same mask function: the CPU fallback), "auto" =
flex on CUDA, sdpa otherwise. How flex is tuned (kernel options, tile) is dflash_model/fast/flex.py.
"""

from __future__ import annotations

from typing import Any, get_args

import torch
import torch.nn.functional as F

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

    ``mask`` is a BlockMask for "flex" or a [Q, KV] bool tensor (True = attend) for "sdpa";
    ``kernel_options`` go to flex_attention (its Triton block sizes), unused by SDPA.
    """
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if backend == "flex":
        # inside a compiled region (compiled draft layers) the plain function is traced in place
        compiled = q.device.type == "cuda" and not torch.compiler.is_compiling()
        out = flex_attention_fn(compiled)(qh, kh, vh, block_mask=mask, enable_gqa=kh.shape[1] != qh.shape[1],
                                          kernel_options=kernel_options)
    else:
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:  # explicit GQA expansion keeps SDPA on its masked fused kernels on every torch version
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out.squeeze(0).transpose(0, 1)
