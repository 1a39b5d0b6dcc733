"""The drafter's optimizer step: fused AdamW with the gradient clip folded into it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dflash_model.fast.settings import triton_installed

KERNELS = ("auto", "triton", "torch")


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
          kernel: str = "auto") -> torch.optim.AdamW:
    """Fused AdamW: one pass over parameters, gradients and moments per step, taking the clip
    as a divisor (``clipped_step``). ``kernel``: "torch" = ``torch.optim.AdamW(fused=True)`` (CPU
    and CUDA); "triton" = ``adamw_triton.TritonAdamW`` (CUDA; same state, a faster norm and
    update); "auto" = triton where every parameter is on CUDA and triton is installed."""
    if kernel not in KERNELS:
        raise ValueError(f"adamw kernel must be one of {KERNELS}, got {kernel!r}")
    params = list(params)
    on_cuda = all(p.device.type == "cuda" for p in params)
    if kernel == "auto":
        kernel = "triton" if on_cuda and triton_installed() else "torch"
    if kernel == "torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    if not on_cuda:
        raise ValueError("the triton AdamW kernel needs the parameters on a CUDA device")
    from dflash_model.fast.adamw_triton import TritonAdamW

    return TritonAdamW(params, lr=lr, weight_decay=weight_decay)


def clipped_step(opt: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients to global L2 norm ``max_norm`` (as ``clip_grad_norm_``; None or 0: no
    clip), take the optimizer step, and return the norm before clipping.

    ``clip_grad_norm_`` rescales every gradient in place: one more read and write of all of them.
    The fused AdamW kernels divide each gradient by
    ``grad_scale`` as they read it (the hook AMP's GradScaler uses), so here the clip costs only
    the norm. The divisor is the inverse of ``clip_grad_norm_``'s factor, clamped the same way."""
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    norm = getattr(opt, "total_norm", torch.nn.utils.get_total_norm)(grads)  # TritonAdamW brings its own
    opt.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0) if max_norm else None
    opt.step()
    return norm
