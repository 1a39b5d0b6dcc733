"""The draft layers' MLP products in FP8 while training (``mlp_dtype: fp8``).

Why: at the Qwen3.6-27B drafter shape the MLP is the largest part of a training step (44% of it,
docs/benchmarks.md, session 11), all of it matrix products that run near the bf16 rate at the
H200's power cap. FP8 tensor cores run the same products close to twice as fast.

Unlike the frozen LM head (``fp8_head``), these weights change at every step, so each product
quantizes its weight as it runs: a read of the bf16 weight and a write of its fp8 copy, which at
this shape is a larger operand than the 8,192 rows of activations. Two of a linear layer's three
products go through FP8:

- forward ``y = x @ W.T``: x and W e4m3, one scale per row of x and per output row of W;
- input gradient ``dx = g @ W``: g e5m2 (a gradient's range, as for the head), W e4m3 with one
  scale per input column;
- the weight gradient ``dW = g.T @ x`` stays in the weight's dtype, a choice of precision: it is
  what the optimizer adds to the weights. (It could run in FP8 too, with g and x scaled along the
  tokens, the axis it sums over.)

Scales are amax / the format's largest value, per row, computed from the tensor itself at each
product (no history), as in ``fp8_head``.
"""

from __future__ import annotations

import torch

from dflash_model.drafter.fp8_head import GRAD8, quantize_operand, reference_product, scaled_product, second_operand
from dflash_model.target.fp8 import FP8


class _FP8Linear(torch.autograd.Function):
    """x [M, K] @ w.T for w [N, K], with the forward and the input gradient through FP8."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return scaled_product(x, FP8, *second_operand(w, _quantize), x.dtype, dynamic=True)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:  # w.t(): one scale per input column
            dx = scaled_product(g, GRAD8, *second_operand(w.t(), _quantize), x.dtype, dynamic=True)
        if ctx.needs_input_grad[1]:
            dw = g.t().to(w.dtype) @ x.to(w.dtype)
        return dx, dw


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_operand(x, dtype, dynamic=True)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), its forward and input gradient in FP8; ``x`` [..., K]."""
    out = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight)
    return out.view(*x.shape[:-1], weight.shape[0])


def reference_linear(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """What :func:`fp8_linear` computes for 2-D ``x``, in float64 from the dequantized operands:
    the forward ``x @ W.T``, or with ``g`` the input gradient ``g @ W``; up to accumulation order
    and the rounding of the output."""
    if g is None:
        return reference_product(x, FP8, *second_operand(weight))
    return reference_product(g, GRAD8, *second_operand(weight.t()))
