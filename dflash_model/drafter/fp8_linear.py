"""The draft layers' MLP products in FP8 while training (``mlp_dtype: fp8``).

Why: at the Qwen3.6-27B drafter shape the MLP is the largest part of a training step (44% of it,
docs/benchmarks.md, session 11), all of it matrix products that run near the bf16 rate at the
H200's power cap. FP8 tensor cores run the same products close to twice as fast.

Unlike the frozen LM head (``fp8_head``), these weights change at every step, so each product
quantizes its weight as it runs (one read of the bf16 weight, the fp8 copy written once; at 8,192
rows the weights are the smaller operand). Two of a linear layer's three products go through FP8:

- forward ``y = x @ W.T``: x and W e4m3, one scale per row of x and per output row of W;
- input gradient ``dx = g @ W``: g e5m2 (a gradient's range, as for the head), W e4m3 with one
  scale per input column;
- weight gradient ``dW = g.T @ x`` stays in the weight's dtype: it is what the optimizer adds to
  the weights, and its rows (tokens) are the product's reduction axis, which row-wise scales of g
  and x do not cover.

Scales are amax / the format's largest value, per row, computed from the tensor itself at each
product (no history), as in ``fp8_head``.
"""

from __future__ import annotations

import torch

from dflash_model.drafter.fp8_head import ALIGN, GRAD8, quantize_operand, quantize_rows, scaled_product
from dflash_model.target.fp8 import FP8


class _FP8Linear(torch.autograd.Function):
    """x [M, K] @ w.T for w [N, K], with the forward and the input gradient through FP8."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        w_rows, w_scale = quantize_operand(w, FP8)  # [N, K]: one scale per output row
        return scaled_product(x, FP8, w_rows, w_scale.t().contiguous(), x.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        w_cols, w_scale = quantize_operand(w.t(), FP8)  # [K, N] row-major: one scale per input column
        dx = scaled_product(g, GRAD8, w_cols, w_scale.t().contiguous(), x.dtype)
        dw = g.t().to(w.dtype) @ x.to(w.dtype)
        return dx, dw


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for 2-D ``x``, its forward and input gradient in FP8."""
    return _FP8Linear.apply(x, weight)


def fits_fp8(*sizes: int) -> bool:
    """Whether every inner and output size of a product is one ``torch._scaled_mm`` takes."""
    return all(n % ALIGN == 0 for n in sizes)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in float64 from the dequantized operands: the forward
    ``x @ W.T``, or with ``g`` the input gradient ``g @ W``; up to accumulation order and the
    rounding of the output."""
    if g is None:
        a, a_dtype, b = x, FP8, weight
    else:
        a, a_dtype, b = g, GRAD8, weight.t()
    qa, sa = quantize_rows(a, a_dtype)
    qb, sb = quantize_rows(b, FP8)
    return (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
