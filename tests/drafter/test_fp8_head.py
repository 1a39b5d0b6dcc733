"""The FP8 LM head of the loss (``lm_head_dtype: fp8``): its products equal the math of their
dequantized operands, the loss and gradient it gives stay near the float head's, and the
trainer takes it. Runs ``torch._scaled_mm``'s CPU kernel; the H200 timing is
benchmarks/train_step.py --lm-head fp8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_model.drafter.fp8_head import FP8, GRAD8, FP8LMHead, head_back, head_logits, quantize_rows
from dflash_model.drafter.loss import ChunkedLMHeadLoss
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import weights_digest
from tests.stages.test_drafter_init import header, tiny_qwen3, trainer
from tests.stages.test_train_step import LAYERS, feature_rows


def head_weight(V: int = 96, H: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_rows_are_scaled_to_the_e4m3_range_and_a_zero_row_stays_zero() -> None:
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    x[2] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (5, 1)
    assert torch.equal(q[2].float(), torch.zeros(32)) and scale[2].item() == 1.0
    top = q.float().abs().amax(-1)
    assert torch.equal(top[[0, 1, 3, 4]], torch.full((4,), 448.0))  # each row's largest value lands on 448
    assert torch.allclose(q.float() * scale, x, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("rows", [16, 21])  # 21: padded to 32 rows inside, the pad cut off
def test_both_products_are_the_math_of_their_dequantized_operands(rows: int) -> None:
    W = head_weight()
    head = FP8LMHead(W)
    h = torch.randn(rows, 48, generator=torch.Generator().manual_seed(2))
    g = torch.randn(rows, 96, generator=torch.Generator().manual_seed(3))
    for got, want in ((head.logits(h), head.reference(h)), (head.back(g), head.reference(g, back=True))):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # and near the float products, within FP8's rounding
    assert ((head.logits(h) - h @ W.t()).norm() / (h @ W.t()).norm()).item() < 0.06
    assert ((head.back(g) - g @ W).norm() / (g @ W).norm()).item() < 0.10  # g in e5m2: 2 mantissa bits


def test_a_head_off_the_16_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8LMHead(head_weight(V=90))


def test_the_loss_through_the_fp8_head_stays_near_the_float_one() -> None:
    """Same rows, labels and coefficients: the FP8 head's loss within 1% and its gradient within
    10% (relative norm; the gradient goes through e5m2) of the float head's; every row's argmax
    that is clear by a margin agrees."""
    W = head_weight(V=256, H=64)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(40, 64, generator=gen, requires_grad=True)
    y = torch.randint(0, 256, (40,), generator=gen)
    coef = torch.rand(40, generator=gen)
    coef = coef / coef.sum()
    outs = []
    for head in (W, FP8LMHead(W)):
        hh = h.detach().clone().requires_grad_(True)
        loss, pred, _ = ChunkedLMHeadLoss.apply(hh, head, coef, y, None, 16, False)
        loss.backward()
        outs.append((loss.detach(), pred, hh.grad))
    (l_ref, p_ref, g_ref), (l_fp8, p_fp8, g_fp8) = outs
    assert abs(l_fp8 - l_ref).item() / l_ref.item() < 0.01
    assert ((g_fp8 - g_ref).norm() / g_ref.norm()).item() < 0.10
    logits = h.detach() @ W.t()
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * logits.std()
    assert clear.sum() > 10 and torch.equal(p_fp8[clear], p_ref[clear])


def test_the_trainer_steps_through_the_fp8_head(tmp_path: Path) -> None:
    """``lm_head_dtype: fp8``: the trainer's head is the FP8 copy, it trains, and its weights move
    otherwise than the float head's (the products differ), from the same start."""
    target = dict(tiny_qwen3(), vocab_size=512)  # FP8 products want multiples of 16
    rows = feature_rows(target["hidden_size"])
    digests = {}
    for kind in ("model", "fp8"):
        cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, lm_head_dtype=kind)
        t = trainer(cfg, header(target, LAYERS), tmp_path / kind)
        assert isinstance(t.head, FP8LMHead) == (kind == "fp8")
        losses = [float(t.train_step([row]).row_stats[0]["loss"]) for row in rows]
        assert all(torch.isfinite(torch.tensor(losses)))
        digests[kind] = weights_digest(t.model)
    assert digests["model"] != digests["fp8"]


def test_train_config_lm_head_dtype() -> None:
    assert TrainConfig().lm_head_dtype == "model"
    with pytest.raises(ValueError, match="lm_head_dtype"):
        TrainConfig(lm_head_dtype="int8")


def test_the_gradient_keeps_the_small_probabilities_of_a_large_vocabulary() -> None:
    """An untrained drafter spreads its softmax over the whole vocabulary: at 262,144 tokens each
    probability is 3.8e-6, in e4m3's subnormals at a row scale of amax / 448, where all of them
    round up alike by 15%. The gradient operand is e5m2, whose normal range holds them: the
    gradient through the FP8 head stays within 15% of the float one (60% in e4m3: the rows share
    a direction, so the softmax part nearly cancels the label's, and its error is what remains)."""
    V, H = 262_144, 16
    shared = torch.randn(H, generator=torch.Generator().manual_seed(7))
    W = (shared + 0.2 * head_weight(V=V, H=H, seed=5) / 0.05) * 0.01  # rows share a direction: the softmax
    # part of the gradient, Σ p_v W_v, is then as large as the label's part, and cancels most of it
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(16, H, generator=gen) * 0.01  # logits near 0: the softmax near uniform
    y = torch.randint(0, V, (16,), generator=gen)
    coef = torch.full((16,), 1 / 16)
    grads = []
    for head in (W, FP8LMHead(W)):
        hh = h.clone().requires_grad_(True)
        ChunkedLMHeadLoss.apply(hh, head, coef, y, None, 16, False)[0].backward()
        grads.append(hh.grad)
    ref, fp8 = grads
    assert ((fp8 - ref).norm() / ref.norm()).item() < 0.15


def cublaslt_scaled_mm(real):
    """``torch._scaled_mm`` that first asserts what torch's CUDA build takes on Hopper with row-wise
    scales (its CPU kernel takes any layout, so these tests would pass an H200 failure otherwise):
    ``a`` row-major and contiguous, ``b`` column-major (``b.t()`` contiguous), every dimension a
    multiple of 16, float32 scales [M, 1] and [1, N], contiguous, and a dtype pair both of its
    row-wise paths take (cuBLASLt: never e5m2 x e5m2; the CUTLASS kernel: ``b`` e4m3)."""
    calls = []

    def checked(a, b, *, scale_a, scale_b, out_dtype=None, **kw):
        (M, K), (K2, N) = a.shape, b.shape
        assert K == K2 and M % 16 == 0 and K % 16 == 0 and N % 16 == 0, (a.shape, b.shape)
        assert a.stride(1) == 1 and a.is_contiguous(), f"a must be row-major: stride {a.stride()}"
        assert b.stride(0) == 1 and b.t().is_contiguous(), f"b must be column-major: stride {b.stride()}"
        for scale, shape in ((scale_a, (M, 1)), (scale_b, (1, N))):
            assert scale.dtype == torch.float32 and scale.shape == shape and scale.is_contiguous(), (
                scale.dtype, scale.shape, scale.stride())
        assert (a.dtype, b.dtype) in ((FP8, FP8), (GRAD8, FP8)), (a.dtype, b.dtype)
        assert out_dtype in (torch.bfloat16, torch.float16, torch.float32), out_dtype
        calls.append((a.dtype, b.dtype))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)

    return checked, calls


def strided_views(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x`` [R, C] as the loss may hand it over: contiguous, a row-strided slice of a wider
    buffer (as a chunk of padded logits), and a transposed copy seen through ``.t()``."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 16, dtype=x.dtype)
    wide[:, :x.shape[1]] = x
    return {"contiguous": x, "row-strided": wide[:, :x.shape[1]], "transposed": x.t().contiguous().t()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [16, 21])
def test_both_products_hand_cublaslt_the_layouts_it_takes(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                          dtype: torch.dtype) -> None:
    """The H200 failure (``Only multiplication of row-major and column-major matrices is supported
    by cuBLASLt`` in ``back``): the head's gradient copy was quantized from ``W.t()`` and kept its
    layout, so the second operand of ``g @ W`` was row-major. Both products, from any view of
    their first operand, now pass cuBLASLt's rules, and give what the contiguous operand gives."""
    checked, calls = cublaslt_scaled_mm(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", checked)
    W = head_weight().to(dtype)
    head = FP8LMHead(W)
    assert head.by_row.is_contiguous() and head.by_col.is_contiguous()
    h = torch.randn(rows, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    g = torch.randn(rows, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    for name, view in strided_views(h).items():
        torch.testing.assert_close(head_logits(view, head), head_logits(h, head), rtol=0, atol=0, msg=name)
    for name, view in strided_views(g).items():
        torch.testing.assert_close(head_back(view, head), head_back(g, head), rtol=0, atol=0, msg=name)
    assert calls.count((FP8, FP8)) == 6 and calls.count((GRAD8, FP8)) == 6


@pytest.mark.parametrize("target", ["data", "kl"])
def test_the_loss_hands_cublaslt_the_layouts_it_takes(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """The loss's chunks (hard labels and the KL one) through the FP8 head pass cuBLASLt's rules."""
    checked, calls = cublaslt_scaled_mm(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", checked)
    W = head_weight(V=256, H=64)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(40, 64, generator=gen, requires_grad=True)
    y = torch.randint(0, 256, (40,), generator=gen)
    coef = torch.rand(40, generator=gen)
    soft = torch.randn(40, 64, generator=gen) if target == "kl" else None
    labels = None if target == "kl" else y
    loss, _, _ = ChunkedLMHeadLoss.apply(h, FP8LMHead(W), coef, labels, soft, 16, False)
    loss.backward()
    assert torch.isfinite(h.grad).all() and (GRAD8, FP8) in calls
