"""AdamW and the gradient norm as Triton kernels, one full-grid launch per parameter (CUDA).

Why: torch's fused AdamW and ``_foreach_norm`` walk the parameters in multi-tensor launches of
a few hundred blocks each, too few to stream a large drafter's update at the memory's speed. A
launch per parameter fills the GPU. It costs the host two Triton launches per parameter a step,
which the training step hides (its host time is a fraction of its GPU time), and the two small
kernels compile in seconds, much faster than Inductor's foreach code for the same update. One
launch for all parameters, through device tables of pointers, was slower (docs/benchmarks.md).

The arithmetic and the state layout are torch's fused AdamW's (``step`` a float32 tensor on the
parameter's device, ``exp_avg``/``exp_avg_sq`` in the parameter's dtype, float32 math, IEEE
division and square root), so ``TritonAdamW`` saves and loads the same optimizer state as
``torch.optim.AdamW(fused=True)``. This module imports triton; ``optim.adamw`` decides when to use it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program of the update (the fastest measured; benchmarks/optim_step.py)
NORM_BLOCK = 2048  # ... and of the norm
NUM_WARPS = 4


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n, step_ptr, scale_ptr, lr, beta1, beta2, log2_beta1,
                  log2_beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    step = tl.load(step_ptr).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)  # 1 - beta1^step
    bias2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
    g = tl.load(g_ptr + offs, mask=inside).to(tl.float32)
    if HAS_SCALE:  # the clip: gradients divided by max(1, norm / max_norm) as they are read
        g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
    p = tl.load(p_ptr + offs, mask=inside).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=inside).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=inside).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE square root and division (tl.sqrt and / are approximate on GPUs), as torch computes
    p = p - tl.div_rn(tl.div_rn(lr, bias1) * m, tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=inside)
    if HAS_COPY:  # master weights: the low-precision weight the model computes with, rounded here
        tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=inside)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=inside)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sumsq_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """out[program] = Σ x² over the program's block (float32): partial sums, added up after."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x * x, axis=0))


def total_norm(tensors: list[torch.Tensor], block: int = NORM_BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Global L2 norm of ``tensors`` (float32 scalar on their device), as ``get_total_norm``.

    Deterministic: each program writes its own partial sum (no atomics), one reduction adds them.
    Each tensor's partial sums start 16-byte aligned (zeros between), so that Triton compiles the
    kernel once rather than once per alignment of its output pointer."""
    if not tensors:
        return torch.nn.utils.get_total_norm(tensors)
    blocks = [triton.cdiv(t.numel(), block) for t in tensors]
    slots = [4 * triton.cdiv(nb, 4) for nb in blocks]
    partial = torch.zeros(sum(slots), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, nb, width in zip(tensors, blocks, slots):
        _sumsq_kernel[(nb,)](_flat(t), t.numel(), partial[start:start + nb], BLOCK=block, num_warps=num_warps)
        start += width
    return partial.sum().sqrt()


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                 grad_scale: torch.Tensor | None, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, copy: torch.Tensor | None = None, block: int = BLOCK,
                 num_warps: int = NUM_WARPS) -> None:
    """One AdamW update of ``p`` and its moments in place (``step`` already counts this one;
    the gradient, of any float dtype, is divided by ``grad_scale`` when given). ``copy``: a
    tensor of ``p``'s shape that also receives the updated ``p``, rounded to its dtype."""
    beta1, beta2 = betas
    _adamw_kernel[(triton.cdiv(p.numel(), block),)](
        p, _flat(g), m, v, copy if copy is not None else p, p.numel(), step,
        grad_scale if grad_scale is not None else step, lr, beta1, beta2, math.log2(beta1), math.log2(beta2), eps,
        weight_decay, HAS_SCALE=grad_scale is not None, HAS_COPY=copy is not None, BLOCK=block,
        num_warps=num_warps)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The kernels index elements 0..n-1 of contiguous memory."""
    return t if t.is_contiguous() else t.contiguous()


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with its step done by ``adamw_update``.

    Same constructor, state and ``grad_scale`` hook (set by ``optim.clipped_step``); torch's
    kernel also writes the unscaled gradients back when given a ``grad_scale``, this one leaves
    them as they are. No amsgrad, maximize or tensor learning rates (refused). Parameters must be
    contiguous (nn.Linear's are)."""

    total_norm = staticmethod(total_norm)  # the clip's norm, read by ``optim.clipped_step``

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, fused=True, **kwargs)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
                raise ValueError("TritonAdamW: amsgrad, maximize and tensor lr are not supported")
            if not all(p.is_contiguous() for p in group["params"]):
                raise ValueError("TritonAdamW: parameters must be contiguous")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._update(group, [(p, p.grad, None) for p in group["params"] if p.grad is not None])
        return loss

    @torch.no_grad()
    def step_masters(self, grads: list[torch.Tensor | None], copies: list[torch.Tensor]) -> None:
        """The step of ``optim.MasterAdamW`` in one pass per parameter: each float32 master (this
        optimizer's parameters, in order) takes its low-precision gradient ``grads[i]`` as it is
        (no float32 copy of it is made) and writes its update rounded into ``copies[i]``, the
        weight the model computes with. A None gradient skips its parameter."""
        if len(grads) != len(copies) or len(grads) != sum(len(g["params"]) for g in self.param_groups):
            raise ValueError("step_masters: one gradient and one copy per parameter, in order")
        pairs = iter(zip(grads, copies))
        for group in self.param_groups:  # each takes the next len(params) pairs
            self._update(group, [(p, g, c) for p, (g, c) in zip(group["params"], pairs) if g is not None])

    def _update(self, group: dict[str, Any],
                todo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """AdamW on (parameter, gradient, copy or None) of one group, the steps counted first."""
        if not todo:
            return
        for p, _, _ in todo:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p, _, _ in todo]
        torch._foreach_add_([st["step"] for st in states], 1.0)
        grad_scale = getattr(self, "grad_scale", None)
        for (p, g, copy), st in zip(todo, states):
            adamw_update(p, g, st["exp_avg"], st["exp_avg_sq"], st["step"], grad_scale, group["lr"],
                         group["betas"], group["eps"], group["weight_decay"], copy)
