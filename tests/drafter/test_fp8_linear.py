"""The draft layers' MLP in FP8 while training (``mlp_dtype: fp8``): each product equals the math of
its dequantized operands, the weight gradient is the float one, an FP8 MLP stays near the float
MLP, and the trainer takes it without changing what it exports. Runs ``torch._scaled_mm``'s CPU
kernel; the H200 timing is benchmarks/train_step.py --mlp fp8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_model.drafter.config import DrafterConfig
from dflash_model.drafter.fp8_linear import fp8_linear, reference_linear
from dflash_model.drafter.model import MLP, DFlashDrafter
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import weights_digest
from tests.stages.test_drafter_init import header, tiny_qwen3, trainer
from tests.stages.test_train_step import LAYERS, feature_rows


def operands(rows: int, k: int = 48, n: int = 80, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05,
            torch.randn(rows, n, generator=gen))


@pytest.mark.parametrize("rows", [32, 21])  # 21: padded to 32 rows inside, the pad cut off
def test_forward_and_input_gradient_are_the_math_of_their_dequantized_operands(rows: int) -> None:
    x, w, g = operands(rows)
    xx = x.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    y = fp8_linear(xx, ww)
    y.backward(g)
    assert y.shape == (rows, 80) and xx.grad.shape == x.shape
    torch.testing.assert_close(y.double(), reference_linear(x, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xx.grad.double(), reference_linear(x, w, g), rtol=1e-5, atol=1e-6)
    # the weight gradient is not quantized: exactly the float product
    assert torch.equal(ww.grad, g.t() @ x)
    # and both quantized products near the float ones, within FP8's rounding
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.06
    assert ((xx.grad - g @ w).norm() / (g @ w).norm()).item() < 0.10  # g in e5m2: 2 mantissa bits


def test_leading_dimensions_are_rows_and_a_frozen_weight_gets_no_gradient() -> None:
    x, w, g = operands(32)
    xx = x.view(4, 8, 48).clone().requires_grad_(True)
    y = fp8_linear(xx, w)  # w needs no gradient: only dx is computed
    assert y.shape == (4, 8, 80) and torch.equal(y.view(32, 80), fp8_linear(x, w))
    y.backward(g.view(4, 8, 80))
    torch.testing.assert_close(xx.grad.view(32, 48).double(), reference_linear(x, w, g), rtol=1e-5, atol=1e-6)
    assert w.grad is None


def mlp_pair(hidden: int = 64, inter: int = 128) -> tuple[MLP, MLP]:
    cfg = DrafterConfig.from_target(tiny_qwen3(hidden=hidden) | {"intermediate_size": inter}, num_layers=1,
                                    block_size=4, target_layer_ids=None, mask_token_id=3)
    torch.manual_seed(0)
    ref = MLP(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    fp8 = MLP(cfg)
    fp8.load_state_dict(ref.state_dict())
    fp8.fp8 = True
    return ref, fp8


def test_an_fp8_mlp_stays_near_the_float_one_with_the_same_weights() -> None:
    """Same weights, same rows: output within 8% and the input's and every weight's gradient within
    10% (relative norm; two FP8 products in a row, about 6% and 7% on these rows); gate and up run
    as one product, so their gradients come out of its split."""
    ref, fp8 = mlp_pair()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    outs = []
    for mlp in (ref, fp8):
        xx = x.clone().requires_grad_(True)
        y = mlp(xx)
        y.square().mean().backward()
        outs.append((y.detach(), xx.grad, {n: p.grad for n, p in mlp.named_parameters()}))
    (y_ref, dx_ref, dw_ref), (y8, dx8, dw8) = outs
    assert not torch.equal(y8, y_ref)  # the FP8 path ran
    assert ((y8 - y_ref).norm() / y_ref.norm()).item() < 0.08
    assert ((dx8 - dx_ref).norm() / dx_ref.norm()).item() < 0.10
    assert dw8.keys() == dw_ref.keys() == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    for name in dw_ref:
        assert ((dw8[name] - dw_ref[name]).norm() / dw_ref[name].norm()).item() < 0.10, name


def test_sizes_off_the_16_grid_are_refused() -> None:
    cfg = tiny_qwen3(hidden=40)  # hidden 40, intermediate 80
    drafter = DFlashDrafter(cfg, mask_token_id=3, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="multiples of 16"):
        drafter.use_fp8_mlp()
    assert not drafter.layers[0].mlp.fp8


def test_the_trainer_trains_an_fp8_mlp_and_exports_the_same_tensors(tmp_path: Path) -> None:
    """``mlp_dtype: fp8``: every draft layer's MLP runs FP8, it trains, its weights move otherwise
    than the float MLP's from the same start, and the checkpoint's tensors have the same names,
    shapes and dtypes (the export does not know how the weights were trained)."""
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])
    digests, shapes = {}, {}
    for kind in ("model", "fp8"):
        cfg = TrainConfig(num_layers=2, block_size=4, num_anchors=8, lr=1e-2, mlp_dtype=kind)
        t = trainer(cfg, header(target, LAYERS), tmp_path / kind)
        assert [layer.mlp.fp8 for layer in t.model.layers] == [kind == "fp8"] * 2
        losses = [float(t.train_step([row]).row_stats[0]["loss"]) for row in rows]
        assert all(torch.isfinite(torch.tensor(losses)))
        digests[kind] = weights_digest(t.model)
        shapes[kind] = {n: (tuple(p.shape), p.dtype) for n, p in t.model.state_dict().items()}
    assert digests["model"] != digests["fp8"]
    assert shapes["model"] == shapes["fp8"]


def test_train_config_mlp_dtype() -> None:
    assert TrainConfig().mlp_dtype == "model"
    with pytest.raises(ValueError, match="mlp_dtype"):
        TrainConfig(mlp_dtype="int8")


def test_the_fp8_mlp_compiles_to_one_graph_for_any_row_count_and_equals_eager() -> None:
    """The trainer compiles the MLP half with its row count dynamic (``compile_layers``): the FP8
    path traces (its autograd function, the quantization and ``_scaled_mm``) into one graph that
    serves 40, 48 (no padding) and 24 rows, with the eager path's output and input gradient."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, fp8 = mlp_pair()
    compiled = torch.compile(lambda x: fp8(x))
    for rows in (40, 48, 24):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        torch._dynamo.maybe_mark_dynamic(xc, 0)
        yc, ye = compiled(xc), fp8(xe)
        yc.square().mean().backward()
        ye.square().mean().backward()
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-7)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
