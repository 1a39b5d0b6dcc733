"""loss_triton.hard_chunk (the LM-head loss chunk's Triton kernels) against loss._hard_chunk.
Without a GPU the kernels run through Triton's interpreter (tests/conftest.py); the H200 timing is
benchmarks/loss_chunk.py."""

import pytest
import torch

from dflash_model.drafter import loss as loss_mod

pytest.importorskip("triton", reason="the kernels are Triton code (the test extra installs triton)")
from dflash_model.fast import loss_triton  # noqa: E402  (imports triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, H, V, BLOCK = 7, 16, 1000, 256  # 4 tiles a row, the last one partial (232 logits)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    coef = torch.rand(ROWS, generator=g)
    coef[2] = 0.0  # an unsupervised slot
    y = torch.tensor([0, 999, 255, 256, 768, 500, 3])  # first and last logit, tile edges
    return h.to(DEV, dtype), weight.to(DEV, dtype), coef.to(DEV), y.to(DEV)


def test_hard_chunk_equals_plain_ops():
    h, weight, coef, y = _inputs()
    loss, pred, grad = loss_triton.hard_chunk(h, weight, coef, y, block=BLOCK)
    ref_loss, ref_pred, ref_grad = loss_mod._hard_chunk(h, weight, coef, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert grad[2].abs().max() == 0  # coefficient 0: no gradient
    assert loss.dtype == torch.float32 and pred.dtype == torch.long and grad.dtype == h.dtype


def test_hard_chunk_argmax_is_the_first_maximum_across_tiles():
    h, weight, coef, y = _inputs()
    h = h.abs()
    weight[[700, 600, 40, 5, 900]] = 10.0  # the same largest logit twice in tiles 0 and 2, once in 3
    _, pred, _ = loss_triton.hard_chunk(h, weight, coef, y, block=BLOCK)
    assert pred.tolist() == [5] * ROWS
    assert torch.equal(pred, (h @ weight.t()).argmax(-1))


def test_hard_chunk_bf16():
    """bf16 logits (the training dtype): the interpreter rounds float32 to bf16 by truncation where
    a GPU rounds to nearest, so the gradient agrees to bf16 precision, loss and argmax exactly."""
    h, weight, coef, y = _inputs(torch.bfloat16)
    loss, pred, grad = loss_triton.hard_chunk(h, weight, coef, y, block=BLOCK)
    ref_loss, ref_pred, ref_grad = loss_mod._hard_chunk(h, weight, coef.float(), y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=0.02, atol=0.02 * ref_grad.abs().max().item())


def test_hard_chunk_through_the_fp8_head_equals_plain_ops():
    """``lm_head_dtype: fp8``: the kernels take the FP8 head's logits and hand their gradient to
    its second product, as the plain chunk does (V and H padded to multiples of 16)."""
    from dflash_model.drafter.fp8_head import FP8LMHead

    h, weight, coef, y = _inputs()
    head = FP8LMHead(torch.cat([weight, weight[:8]]))  # 1,008 rows: a multiple of 16
    loss, pred, grad = loss_triton.hard_chunk(h, head, coef, y, block=BLOCK)
    ref_loss, ref_pred, ref_grad = loss_mod._hard_chunk(h, head, coef, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_chunk_fn_picks_the_kernels_for_hard_labels_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loss_mod.chunk_fn(loss_mod._hard_chunk, cuda, True) is loss_triton.hard_chunk
    assert loss_mod.chunk_fn(loss_mod._hard_chunk, cuda, False) is loss_mod._hard_chunk
    assert loss_mod.chunk_fn(loss_mod._hard_chunk, cpu, True) is loss_mod._hard_chunk
    assert loss_mod.chunk_fn(loss_mod._soft_chunk, cuda, True) is loss_mod._compiled(loss_mod._soft_chunk)


@pytest.mark.parametrize("bad", [V, -1])
def test_labels_outside_the_vocabulary_are_refused(bad):
    """The kernels read a row's label logit from the tile that holds it: a label past the
    vocabulary would leave the loss unset instead of failing, so the loss checks labels first."""
    h, weight, coef, y = _inputs()
    y[3] = bad
    with pytest.raises(RuntimeError, match="token ids of the LM head's vocabulary"):
        loss_mod.ChunkedLMHeadLoss.apply(h, weight, coef, y, None, 4, False)


def test_softmax_grad_refuses_strided_rows():
    logits = torch.zeros(V, ROWS, device=DEV).t()  # [ROWS, V] with a stride of ROWS along a row
    with pytest.raises(ValueError, match="contiguous"):
        loss_triton.softmax_grad_(logits, torch.zeros(ROWS, dtype=torch.long, device=DEV), torch.ones(ROWS, device=DEV))
