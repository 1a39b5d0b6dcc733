"""The frozen LM head in FP8 for the loss's two products (``lm_head_dtype: fp8``).

Why: at the Qwen3.6-27B drafter shape the loss's two LM-head products (logits = h @ W.T, then
d loss/d h = g @ W, with V = 248,320) are about a third of a training step's FLOPs, and FP8 tensor
cores run such products close to twice as fast as bf16 ones (docs/fp8_target.md). The head is
frozen, so it is quantized once, in two layouts: one scale per vocabulary row for the logits, one
per hidden column for the gradient, each the axis ``torch._scaled_mm``'s row-wise scaling takes
for its second operand. The first operand (h, or g) is quantized row by row as it comes.

The head and h are e4m3 with scale amax / 448, as in the FP8 target's layers (``target.fp8``);
the gradient g is e5m2 (``FP8LMHead`` says why). The products run through ``torch._scaled_mm`` on
every device (its CPU kernel is what the tests run); ``reference`` gives the same math in float64
from the dequantized operands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from dflash_model.fast.compile_gate import compiled
from dflash_model.target.fp8 import FP8, scale_of, to_fp8

GRAD8 = torch.float8_e5m2  # the gradient operand: its range keeps the small probabilities (see FP8LMHead)
ALIGN = 16  # _scaled_mm wants every dimension a multiple of 16


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """(``dtype`` [M, K], float32 scale [M, 1]): each row divided by amax / (the format's largest
    value); an all-zero row (a padding row of the loss, coefficient 0) keeps scale 1 and stays zero.

    Both come back contiguous (row-major) whatever the layout of ``x``: an elementwise op keeps a
    transposed input's layout, and cuBLASLt's FP8 product on Hopper takes its first operand
    row-major and its second column-major only (``scaled_product``). The cast writes the
    row-major copy itself, so a transposed or strided ``x`` costs no extra copy of the fp8 tensor."""
    scale = scale_of(x.abs().amax(-1, keepdim=True).float(), dtype).contiguous()
    return to_fp8(x.float() / scale, dtype), scale


@functools.cache
def _compiled_quantize_rows(dynamic: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return compiled(quantize_rows, dynamic=dynamic)


def quantize_operand(x: torch.Tensor, dtype: torch.dtype, dynamic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of a product's operand: on CUDA one fused kernel (read once for the
    row maxima, once for the cast) rather than eager ops that make a float32 copy of it, which for
    a [3,840, 248,320] gradient chunk is 3.8 GB. ``dynamic``: one kernel for any shape, for callers
    whose operands come in many shapes (the MLP's weights, activations and gradients), which would
    otherwise pass Dynamo's limit of compiles per function and fall back to the eager ops."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return _compiled_quantize_rows(dynamic)(x, dtype)
    return quantize_rows(x, dtype)


def second_operand(w: torch.Tensor, quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_rows
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as :func:`scaled_product`'s second operand: e4m3 row-major, so that its
    ``.t()`` is the column-major operand cuBLASLt wants, and its scales as [1, N], one per row."""
    q, scale = quantize(w, FP8)
    return q, scale.t().contiguous()


def scaled_product(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype, dynamic: bool = False) -> torch.Tensor:
    """a [M, K] @ b.T with b [N, K] e4m3 (row-major) and b_scale [1, N] (:func:`second_operand`);
    ``a`` is quantized row by row to ``a_dtype`` on the way (``quantize_operand``'s ``dynamic``),
    its rows padded to a multiple of 16 with zeros (each row is quantized on its own: padding
    changes no other row). Inside a compiled graph the padding is always there, of a size that
    may be 0: a test of the row count would split the graph in two.

    What cuBLASLt's FP8 product takes on Hopper (torch's CUDA ``_scaled_mm`` refuses anything
    else; its CPU kernel takes any layout): the first operand row-major, the second column-major
    (here ``b.t()`` of the row-major ``b``), row-wise scales float32 [M, 1] and [1, N], both
    contiguous, and never e5m2 x e5m2. ``a`` may be any view (the loss's gradient chunk):
    :func:`quantize_rows` writes its fp8 copy row-major."""
    m = a.shape[0]
    pad = -m % ALIGN
    if torch.compiler.is_compiling() or pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
    q, a_scale = quantize_operand(a, a_dtype, dynamic)
    return torch._scaled_mm(q, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)[:m]


def reference_product(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_scale: torch.Tensor
                      ) -> torch.Tensor:
    """What :func:`scaled_product` computes, in float64 from the dequantized operands, up to its
    accumulation order and the rounding of its output."""
    q, a_scale = quantize_rows(a, a_dtype)
    return (q.double() * a_scale.double()) @ (b.double() * b_scale.double().t()).t()


def fits_fp8(*sizes: int) -> bool:
    """Whether every inner and output size of a product is one ``torch._scaled_mm`` takes."""
    return all(n % ALIGN == 0 for n in sizes)


class FP8LMHead:
    """A frozen LM head ``weight`` [V, H] as two e4m3 copies with their scales.

    ``logits(h)`` [R, H] -> [R, V] and ``back(g)`` [R, V] -> [R, H] stand for ``h @ W.T`` and
    ``g @ W`` in the loss, in ``dtype`` (the weight's). ``shape`` and ``dtype`` are the float
    weight's, so the loss reads them as it reads a weight tensor's.

    h is quantized to e4m3, g = coef (softmax - onehot) to e5m2: an untrained drafter's softmax
    over 248,320 tokens puts ~4e-6 on each; at a row scale of amax / 448 that is in e4m3's
    subnormals, which round it by ~15% alike for every token or flush it to zero, while e5m2 holds
    normal numbers down to ~1e-9 of the row's largest value."""

    def __init__(self, weight: torch.Tensor) -> None:
        V, H = weight.shape
        if not fits_fp8(V, H):
            raise ValueError(f"an FP8 LM head needs its vocabulary ({V}) and hidden size ({H}) to be multiples "
                             f"of {ALIGN}; use lm_head_dtype: model")
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device
        w = weight.detach()
        self.by_row, self.row_scale = second_operand(w)      # [V, H], one scale per vocabulary row
        self.by_col, self.col_scale = second_operand(w.t())  # [H, V], one scale per hidden column

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return scaled_product(h, FP8, self.by_row, self.row_scale, self.dtype)

    def back(self, g: torch.Tensor) -> torch.Tensor:
        return scaled_product(g, GRAD8, self.by_col, self.col_scale, self.dtype)

    def reference(self, a: torch.Tensor, back: bool = False) -> torch.Tensor:
        """``logits(a)`` (or ``back(a)``) in float64 from the dequantized operands: what the FP8
        product computes, up to its accumulation order and the rounding of its output."""
        if back:
            return reference_product(a, GRAD8, self.by_col, self.col_scale)
        return reference_product(a, FP8, self.by_row, self.row_scale)


LMHead = torch.Tensor | FP8LMHead


def head_logits(h: torch.Tensor, head: LMHead) -> torch.Tensor:
    """h @ W.T of the loss: in the head's dtype, or through its FP8 copy."""
    return head.logits(h) if isinstance(head, FP8LMHead) else h.to(head.dtype) @ head.t()


def head_back(g: torch.Tensor, head: LMHead) -> torch.Tensor:
    """g @ W of the loss's gradient: in the head's dtype, or through its FP8 copy."""
    return head.back(g) if isinstance(head, FP8LMHead) else g.to(head.dtype) @ head
