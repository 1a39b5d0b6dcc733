"""The FP8 target's activation quantization as one Triton kernel (CUDA).

Why: every ``FP8BlockLinear`` product quantizes its activation rows first (per token, in groups of
128 columns: scale = amax / 448, the values divided by it, clamped to ±448 and rounded to e4m3,
the scales laid out column-major for ``torch._scaled_mm``). Compiled on its own, outside a
compiled layer, Inductor makes that a reduction kernel, a pointwise kernel and copies, and the
target's forward runs it for every linear layer. Here one program takes a tile of rows times one
group: it reads the tile once, reduces each row's amax in registers, writes the e4m3 tile and its
scales straight into the column-major layout. One read of x and one write of q, nothing else.

The values are ``fp8._quantize_columns``'s as torch computes them on CUDA: there ``amax / 448.0``
(a tensor by a Python number) is computed as amax times the float32 reciprocal of 448 (ATen's
scalar division, and Inductor's division by a constant, both do this; on the CPU torch divides,
which rounds differently for about half of all amax values), and x / scale is IEEE division
(``tl.div_rn``; Triton's ``/`` is approximate on GPUs). The CPU tests run the kernel through
Triton's interpreter. This module imports triton; ``fp8._quantize_for_product`` decides when to use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_model.target.fp8 import BLOCK, FP8

ROWS = 16  # rows per program (benchmarks/fp8_quantize.py sweeps this)
NUM_WARPS = 4
FP8_MAX = torch.finfo(FP8).max  # 448
INV_FP8_MAX = torch.tensor(1.0).div(FP8_MAX).item()  # float32's 1/448, the factor ATen multiplies by


@triton.jit
def _max_nan(a, b):
    """max that keeps a NaN, as torch's amax does (``tl.max`` drops it on GPUs)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_kernel(x_ptr, stride, q_ptr, s_ptr, M, K, top, inv_top,
                     ROWS: tl.constexpr, GROUP: tl.constexpr):
    """One tile of ``ROWS`` rows by one group of ``GROUP`` columns: each row's scale (amax / top,
    1 for an all-zero group) into s[group, row], the row's values divided by it into q."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    inside = rows < M
    r64 = rows.to(tl.int64)  # M * K can pass 2^31
    x = tl.load(x_ptr + r64[:, None] * stride + cols[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.where(amax > 0, amax * inv_top, 1.0)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -top, top, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=inside[:, None])
    tl.store(s_ptr + group.to(tl.int64) * M + r64, scale, mask=inside)


def quantize_columns(x: torch.Tensor, out_dtype: torch.dtype = FP8, rows: int = ROWS,
                     num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8._quantize_columns`` of ``x`` [M, K] (bf16, fp16 or float32; K a multiple of 128):
    (q [M, K] row-major, float32 scales [M, K/128] with strides (1, M), column-major as
    ``_scaled_mm``'s 1×128 block scaling wants them). ``out_dtype`` float32 gives the values
    clamped but not yet rounded to e4m3 (for tests: Triton's interpreter casts to e4m3 wrongly)."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"quantize_columns takes [M, K] with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scale = torch.empty(k // BLOCK, m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(triton.cdiv(m, rows), k // BLOCK)](x, x.stride(0), q, scale, m, k, FP8_MAX, INV_FP8_MAX,
                                                            ROWS=rows, GROUP=BLOCK, num_warps=num_warps)
    return q, scale.t()
