"""The LM-head loss chunk against hard labels with its softmax passes as two Triton kernels (CUDA).

Why: between its two products (logits = h @ W.T, then d loss/d h = g @ W) a chunk reads the
[rows, V] logits to reduce them (max, sum of exponentials, argmax, the label's logit) and again to
write the gradient g = coef · (softmax - onehot). Inductor's fused kernel for this gives each row
(151,936 logits) to one program, far fewer programs than the GPU has room for. Here the row is cut
into tiles of ``BLOCK`` logits, one program per (row, tile): the first
kernel writes each tile's max, sum of exponentials and first argmax (and the label's logit, from
the tile holding it), the second combines a row's partials into its log-sum-exp and overwrites the
tile with the gradient in place. One read, then one read and one write of the logits, by tens of
thousands of programs a chunk, close to the memory's speed (docs/benchmarks.md).

Same arithmetic as ``loss._hard_chunk`` (float32 math on the logits as the product rounded them;
argmax the first maximum, as torch's); the CPU tests run these kernels through Triton's
interpreter against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_model.drafter.fp8_head import LMHead, head_back, head_logits

BLOCK = 4096  # logits per program (the fastest measured with 4 warps; benchmarks/loss_chunk.py)
NUM_WARPS = 4


@triton.jit
def _tile_stats_kernel(x_ptr, stride, V, y_ptr, m_ptr, s_ptr, i_ptr, picked_ptr, TILES,
                       BLOCK: tl.constexpr):
    """Max, Σ exp(x - max) and first argmax of one (row, tile); the label's logit if it is here."""
    row, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    out = row * TILES + tile
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, tl.sum(tl.exp(x - m), axis=0))
    tl.store(i_ptr + out, tl.min(tl.where(x == m, cols, V), axis=0))
    y = tl.load(y_ptr + row)
    if y // BLOCK == tile:
        tl.store(picked_ptr + row, tl.sum(tl.where(cols == y, x, 0.0), axis=0))


@triton.jit
def _tile_grad_kernel(x_ptr, stride, V, y_ptr, coef_ptr, m_ptr, s_ptr, i_ptr, picked_ptr, loss_ptr, pred_ptr,
                      TILES, TILES_P2: tl.constexpr, BLOCK: tl.constexpr):
    """The row's log-sum-exp from its tiles' partials; the tile's logits overwritten by
    coef · (softmax - onehot); the first tile of a row also writes its loss and argmax."""
    row, tile = tl.program_id(0), tl.program_id(1)
    parts = row * TILES + tl.arange(0, TILES_P2)
    real = tl.arange(0, TILES_P2) < TILES
    pm = tl.load(m_ptr + parts, mask=real, other=-float("inf"))
    M = tl.max(pm, axis=0)
    lse = M + tl.log(tl.sum(tl.load(s_ptr + parts, mask=real, other=0.0) * tl.exp(pm - M), axis=0))
    coef = tl.load(coef_ptr + row)
    y = tl.load(y_ptr + row)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    ptr = x_ptr + row.to(tl.int64) * stride + cols
    x = tl.load(ptr, mask=inside, other=0.0).to(tl.float32)
    g = (tl.exp(x - lse) - tl.where(cols == y, 1.0, 0.0)) * coef
    tl.store(ptr, g.to(x_ptr.dtype.element_ty), mask=inside)
    if tile == 0:
        tl.store(loss_ptr + row, coef * (lse - tl.load(picked_ptr + row)))
        # tiles are in column order and each holds its first maximum: the least index wins ties
        tl.store(pred_ptr + row, tl.min(tl.where(pm == M, tl.load(i_ptr + parts, mask=real, other=V), V), axis=0))


def softmax_grad_(logits: torch.Tensor, y: torch.Tensor, coef: torch.Tensor, block: int = BLOCK,
                  num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite ``logits`` [rows, V] with coef · (softmax - onehot(y)); return each row's
    coef · CE (float32) and first argmax."""
    rows, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("softmax_grad_: the logits' rows must be contiguous")
    tiles = triton.cdiv(V, block)
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s = torch.empty(rows, tiles, **f32), torch.empty(rows, tiles, **f32)
    idx = torch.empty(rows, tiles, dtype=torch.int32, device=logits.device)
    picked, loss = torch.empty(rows, **f32), torch.empty(rows, **f32)
    pred = torch.empty(rows, dtype=torch.long, device=logits.device)
    y, coef = y.contiguous(), coef.to(torch.float32).contiguous()
    _tile_stats_kernel[(rows, tiles)](logits, logits.stride(0), V, y, m, s, idx, picked, tiles, BLOCK=block,
                                      num_warps=num_warps)
    _tile_grad_kernel[(rows, tiles)](logits, logits.stride(0), V, y, coef, m, s, idx, picked, loss, pred, tiles,
                                     TILES_P2=triton.next_power_of_2(tiles), BLOCK=block, num_warps=num_warps)
    return loss, pred


def hard_chunk(h: torch.Tensor, weight: LMHead, coef: torch.Tensor, y: torch.Tensor,
               block: int = BLOCK, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loss._hard_chunk``: (Σ coef·CE, draft argmax, d loss/d h) of rows ``h`` against labels ``y``."""
    logits = head_logits(h, weight)
    loss, pred = softmax_grad_(logits, y, coef, block, num_warps)
    return loss.sum().to(coef.dtype), pred, head_back(logits, weight).to(h.dtype)
