"""FP8 targets in Qwen's published block-scaled format (``dflash_model.target.fp8``), on CPU.

The block and group math against hand-built tensors; checkpoints we quantize and save (a dense
Qwen3, a Qwen3.5 hybrid text model and a vision-language one) loading back bit for bit, as
transformers' own dequantizing reader sees them too; the CPU reference product; feature extraction
from a loaded FP8 target keeping every document of a packed row to itself; the ``-fp8`` presets;
evaluate's lossless check on an FP8 SmolLM2 (its rounding tolerated, a loop error still caught).
The FP8 product on CUDA (``torch._scaled_mm``) is not run here (docs/fp8_target.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_model.target import fp8
from dflash_model.target.capture import FeatureCapture
from dflash_model.target.load import PRESETS, load_target
from tests.assets import unpack_qwen3_tokenizer
from tests.stages.test_extract import packed_row
from tests.target.test_smollm2_target import DATA, needs_smollm2
from tests.transformers_versions import hybrid_on_cpu, needs_hybrid

H = 256
"""Two 128-wide blocks."""
DENSE = dict(vocab_size=6000, hidden_size=H, intermediate_size=384, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05,
             tie_word_embeddings=False)
"""Whole blocks only, as in the published checkpoints (transformers' reader refuses partial ones)."""
HYBRID_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
HYBRID = dict(DENSE, intermediate_size=320, num_hidden_layers=4, layer_types=HYBRID_TYPES,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4)
"""The MLP's 320 ends in a partial block (the format allows it; our reader takes it)."""
DOCS = (70, 33, 101)  # the first and last cross the linear layers' 64-token chunks
PAD = 12
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(fp8.FP8)
"""Every e4m3 bit pattern: 254 finite values and two NaNs."""


def random_fp8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random finite e4m3 values."""
    finite = FP8_VALUES[~FP8_VALUES.float().isnan()]
    return finite[torch.randint(len(finite), shape, generator=torch.Generator().manual_seed(seed))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- the format's math ---------------------------------------------------------------------------

def test_dequantization_is_each_element_times_its_blocks_scale() -> None:
    """A [300, 200] fp8 weight (3x2 blocks, partial at the far edges) and hand-picked scales:
    every element is multiplied by the scale of the 128x128 block it lies in, exactly."""
    w = random_fp8((300, 200), seed=0)
    scale = torch.tensor([[0.5, 3.0], [2.0 ** -10, 7.25], [1e-3, 448.0]])
    got = fp8.dequantize_blocks(w, scale)
    want = torch.empty(300, 200)
    for i in range(3):
        for j in range(2):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            want[rows, cols] = w[rows, cols].float() * scale[i, j]
    assert torch.equal(got, want)


def test_quantizing_a_weight_takes_each_blocks_amax_over_448() -> None:
    """Scale = the block's amax / 448 (an all-zero block: 1), values = e4m3 rounding of weight /
    scale; a weight already on that grid (each block's amax hits 448) comes back exactly."""
    torch.manual_seed(0)
    weight = torch.randn(300, 200, dtype=torch.bfloat16)
    weight[128:256, 128:] = 0
    q, scale = fp8.quantize_blocks(weight)
    assert q.dtype == fp8.FP8 and scale.dtype == torch.float32 and scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = weight[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            amax = block.abs().max()
            assert scale[i, j] == (amax / 448 if amax > 0 else 1.0)
            got = q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert torch.equal(got, (block / scale[i, j]).to(fp8.FP8))
    assert (q[128:256, 128:].float() == 0).all()
    # on the grid: fp8 values whose block amax is 448, times power-of-two scales
    exact = random_fp8((300, 200), seed=1)
    exact[::128, ::128] = 448.0
    grid_scale = 2.0 ** torch.randint(-12, 2, (3, 2)).float()
    q2, s2 = fp8.quantize_blocks(fp8.dequantize_blocks(exact, grid_scale))
    assert torch.equal(s2, grid_scale) and torch.equal(q2.view(torch.uint8), exact.view(torch.uint8))


def test_activations_are_quantized_per_token_in_groups_of_128() -> None:
    """Each token's 128-column groups (the last one partial) get scale amax / 448 of their own; a
    zero group gets 1; dequantizing multiplies each value back by its group's scale."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 300) * torch.logspace(-3, 2, 300)
    x[1, 2, 128:256] = 0
    q, scale = fp8.quantize_groups(x)
    assert q.shape == x.shape and scale.shape == (2, 5, 3)
    for g, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
        amax = x[..., cols].abs().amax(-1)
        want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        assert torch.equal(scale[..., g], want)
        assert torch.equal(q[..., cols].view(torch.uint8),
                           (x[..., cols] / want[..., None]).to(fp8.FP8).view(torch.uint8))
        assert torch.equal(fp8.dequantize_groups(q, scale)[..., cols], q[..., cols].float() * want[..., None])
    assert scale[1, 2, 1] == 1


def test_fp8_linear_on_cpu_is_the_block_scaled_product() -> None:
    """The CPU forward equals the block-scaled product written out: per token and output, the sum
    over 128-wide groups of (fp8 activation . fp8 weight) x activation scale x weight block scale,
    in float64, plus the bias; in the input's dtype."""
    torch.manual_seed(2)
    linear = nn.Linear(300, 320, bias=True)
    layer = fp8.FP8BlockLinear.quantized(linear)
    assert isinstance(layer.weight, nn.Parameter) and layer.weight.dtype == fp8.FP8
    x = torch.randn(2, 7, 300)
    got = layer(x)
    xq, xs = fp8.quantize_groups(x.reshape(-1, 300))
    wq, ws = layer.weight.double(), layer.weight_scale_inv.double()
    want = torch.zeros(14, 320, dtype=torch.float64)
    for g in range(3):
        cols = slice(128 * g, 128 * (g + 1))
        partial = xq[:, cols].double() @ wq[:, cols].t()  # [tokens, out], exact in float64
        want += partial * xs[:, g, None].double() * ws[:, g].repeat_interleave(128)[None, :320]
    want += linear.bias.double()
    assert got.shape == (2, 7, 320) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.reshape(2, 7, 320), rtol=1e-5, atol=1e-6)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    # against the unquantized layer: the e4m3 rounding of both operands, ~3.6% RMS on Gaussian data
    with torch.no_grad():
        err = float((got - linear(x)).norm() / linear(x).norm())
    print(f"\nFP8 vs float32 product, RMS relative error {err:.4f}", end="")
    assert 0.01 < err < 0.05



def test_half_precision_activations_take_the_reference_math_at_their_precision() -> None:
    """Where the FP8 product cannot run (here a 300-column layer), bf16 activations are multiplied
    in bf16: the dequantized activation and the weight dequantized once (a buffer that moves with
    the layer and is never saved), each rounded to bf16. That is the float32 reference within bf16's
    rounding; float32 activations still get the float32 reference exactly."""
    torch.manual_seed(3)
    layer = fp8.FP8BlockLinear.quantized(nn.Linear(300, 320, bias=False))
    assert not layer.shape_fits_product()
    assert torch.equal(layer.dequantized, layer.dequantized_weight())
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    x = torch.randn(37, 300)
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, layer.reference_product(x.bfloat16(), torch.bfloat16))
    want = layer.reference_product(x.bfloat16())
    err = float((got.float() - want).norm() / want.norm())
    assert 0 < err < 2 ** -7
    assert torch.equal(layer(x), layer.reference_product(x))
    fitting = fp8.FP8BlockLinear.quantized(nn.Linear(256, 128, bias=False))
    assert fitting.shape_fits_product() and fitting.dequantized is None
    assert torch.equal(fitting(x[:, :256]), fitting.reference_product(x[:, :256]))

FP8_GPU = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.fp8_product_available(torch.device("cuda")),
                             reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")


@FP8_GPU
def test_the_fp8_product_on_a_gpu_is_the_reference_math() -> None:
    """On CUDA: the quantization ``fp8_product`` takes (the Triton kernel, or the compiled function
    without triton) is the eager one (scales column-major; a rare value may round differently),
    and ``_scaled_mm`` with both block scales computes the reference product to within bf16
    rounding, for a token count that is no multiple of 16."""
    torch.manual_seed(0)
    linear = nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = fp8.FP8BlockLinear.quantized(linear)
    x = torch.randn(999, 1024, device="cuda", dtype=torch.bfloat16)
    q, scale = fp8._quantize_for_product(x)
    q_eager, scale_eager = fp8.quantize_groups(x)
    assert scale.stride() == (1, 999)
    torch.testing.assert_close(scale, scale_eager, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != q_eager.view(torch.uint8)).float().mean() < 1e-3
    assert layer.fp8_product_fits(x)
    got = layer(x)
    want = layer.reference_product(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, layer.fp8_product(x))
    err = float((got.float() - want).norm() / want.norm())
    print(f"\n_scaled_mm vs the reference math: RMS relative {err:.2e}", end="")
    assert err < 1e-2


def test_patterns_of_modules_to_not_convert() -> None:
    """transformers' reading: from the name's start to a dot (a regex), or a dotted suffix."""
    keep = ["lm_head", "in_proj_a", "model.visual", r"model\.layers\.1\..*"]
    assert not fp8.converted("lm_head", keep)
    assert not fp8.converted("model.layers.0.linear_attn.in_proj_a", keep)
    assert not fp8.converted("model.visual.blocks.0.attn.qkv", keep)
    assert not fp8.converted("model.layers.1.mlp.up_proj", keep)
    assert fp8.converted("model.layers.11.mlp.up_proj", keep)
    assert fp8.converted("model.layers.0.linear_attn.in_proj_qkv", keep)
    assert fp8.converted("model.visual_head.proj", keep)


# --- checkpoints ---------------------------------------------------------------------------------

def dense_model() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DENSE)).eval()


def hybrid_model(kind: str) -> nn.Module:
    """A Qwen3.5 text model, or the vision-language model around it (the Qwen3.6 checkpoints' form)."""
    import transformers

    torch.manual_seed(0)
    if kind == "text":
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID)).eval()
    cfg = transformers.Qwen3_5Config(text_config=HYBRID, tie_word_embeddings=False, vision_config=dict(
        depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=H))
    return transformers.Qwen3_5ForConditionalGeneration(cfg).eval()


def save_pair(model: nn.Module, root: Path) -> tuple[Path, Path, list[str]]:
    """``model`` saved as it is and in the FP8 format, each with the Qwen3 tokenizer."""
    float_dir, fp8_dir = root / "float", root / "fp8"
    model.save_pretrained(float_dir)
    done = fp8.save_fp8_checkpoint(model, fp8_dir)
    return unpack_qwen3_tokenizer(float_dir), unpack_qwen3_tokenizer(fp8_dir), done


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    return save_pair(dense_model(), tmp_path_factory.mktemp("fp8-dense"))


@pytest.fixture(scope="module")
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, Path, list[str]]:
    return save_pair(hybrid_model(request.param), tmp_path_factory.mktemp(f"fp8-{request.param}"))


def fp8_layers(model: nn.Module) -> dict[str, fp8.FP8BlockLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8.FP8BlockLinear)}


def assert_loads_as_saved(float_dir: Path, fp8_dir: Path, saved: list[str], prefix: str = "") -> nn.Module:
    """The FP8 checkpoint loaded: each saved fp8 weight and scale is in the model bit for bit under
    its name (``prefix`` removed: a vision-language checkpoint's text model), every other linear
    layer stays ``nn.Linear`` equal to the float checkpoint's, and so does every other tensor."""
    model, _ = load_target(str(fp8_dir), "cpu", "float32", "sdpa")
    tensors = {k: v for f in fp8_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    layers = fp8_layers(model)
    assert sorted(layers) == sorted(n.replace(prefix, "") for n in saved)
    for name in saved:
        layer = layers[name.replace(prefix, "")]
        assert torch.equal(layer.weight.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, tensors[f"{name}.weight_scale_inv"])
    original = {k.replace(prefix, ""): v for f in float_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    for name, p in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in layers:
            assert torch.equal(p, original[name]), name
    return model


def test_a_dense_checkpoint_round_trips(dense: tuple[Path, Path, list[str]]) -> None:
    """config.json has the published quantization_config; the attention and MLP projections are
    fp8 with their scales, the LM head stays as it was."""
    float_dir, fp8_dir, saved = dense
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128], "modules_to_not_convert": list(fp8.NOT_CONVERTED)}
    assert len(saved) == 3 * 7
    model = assert_loads_as_saved(float_dir, fp8_dir, saved)
    assert type(model.lm_head) is nn.Linear
    assert fp8_layers(model)["model.layers.0.mlp.up_proj"].weight_scale_inv.shape == (3, 2)


@needs_hybrid
@pytest.mark.parametrize("hybrid", ["text", "vision_language"], indirect=True)
def test_a_hybrid_checkpoint_round_trips(hybrid: tuple[Path, Path, list[str]]) -> None:
    """Qwen3.5: the Gated DeltaNet's in_proj_qkv / in_proj_z / out_proj and the attention and MLP
    projections are fp8; in_proj_a / in_proj_b, the LM head (and the vision tower) are not; a
    vision-language checkpoint loads as its text model, its scales found under the text names."""
    float_dir, fp8_dir, saved = hybrid
    prefix = "language_model." if "language_model" in saved[0] else ""
    assert len(saved) == 3 * (3 + 3) + 1 * (4 + 3)
    assert not [n for n in saved if "visual" in n or "in_proj_a" in n or "in_proj_b" in n]
    model = assert_loads_as_saved(float_dir, fp8_dir, saved, prefix)
    assert type(model.model.layers[0].linear_attn.in_proj_a) is nn.Linear
    assert fp8_layers(model)["model.layers.0.mlp.up_proj"].weight_scale_inv.shape == (3, 2)  # 320 rows


def test_a_sharded_checkpoint_round_trips(tmp_path: Path) -> None:
    """Written in several shards, each scale listed in the index beside its weight: it loads back
    as the one-file checkpoint does."""
    model = dense_model()
    model.save_pretrained(tmp_path / "float")
    saved = fp8.save_fp8_checkpoint(model, tmp_path / "fp8", max_shard_size="300KB")
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    assert all(index[f"{n}.weight_scale_inv"] == index[f"{n}.weight"] for n in saved)
    unpack_qwen3_tokenizer(tmp_path / "fp8")
    assert_loads_as_saved(tmp_path / "float", tmp_path / "fp8", saved)


def test_scales_stored_in_bf16_load_as_float32(dense: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    """Some published checkpoints store ``weight_scale_inv`` in bf16: read as they are, widened."""
    import shutil

    _, fp8_dir, _ = dense
    shutil.copytree(fp8_dir, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(file)
    narrowed = {k: v.bfloat16() if k.endswith("weight_scale_inv") else v for k, v in tensors.items()}
    save_file(narrowed, file, metadata={"format": "pt"})
    model, _ = load_target(str(tmp_path / "ckpt"), "cpu", "float32", "sdpa")
    for name, layer in fp8_layers(model).items():
        assert torch.equal(layer.weight_scale_inv, narrowed[f"{name}.weight_scale_inv"].float())


def test_a_scaled_weight_not_in_e4m3_is_refused(dense: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    """A weight with a scale beside it that holds values e4m3 cannot (a float weight left in by a
    broken writer) is an error, not a silently different model."""
    import shutil

    _, fp8_dir, saved = dense
    shutil.copytree(fp8_dir, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(file)
    key = f"{saved[0]}.weight"
    tensors[key] = tensors[key].float() + 0.01
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not stored as e4m3 values"):
        load_target(str(tmp_path / "ckpt"), "cpu", "float32", "sdpa")


def test_transformers_dequantizes_our_checkpoint_to_our_weights(dense: tuple[Path, Path, list[str]]) -> None:
    """transformers' own reader of the format (``FineGrainedFP8Config(dequantize=True)``, the path
    it takes without a GPU) gives each layer the very weight our layers stand for."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _, fp8_dir, _ = dense
    theirs = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True))
    ours, _ = load_target(str(fp8_dir), "cpu", "float32", "sdpa")
    for name, layer in fp8_layers(ours).items():
        assert torch.equal(layer.dequantized_weight(), theirs.get_submodule(name).weight), name


def test_a_hub_name_of_an_fp8_checkpoint_asks_for_a_directory(dense: tuple[Path, Path, list[str]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import PretrainedConfig

    _, fp8_dir, _ = dense
    raw = json.loads((fp8_dir / "config.json").read_text())
    monkeypatch.setattr(PretrainedConfig, "get_config_dict", classmethod(lambda cls, name, **kw: (raw, {})))
    with pytest.raises(ValueError, match="--local-dir"):
        fp8.checkpoint_fp8_config("Qwen/Qwen3-8B-FP8")


# --- features --------------------------------------------------------------------------------------

def in_float64(model: nn.Module) -> nn.Module:
    """``model`` computing in float64, its e4m3 weights kept. Why: an e4m3 rounding step is 1/8 to
    1/16 of a value, so a one-ulp float32 difference between two ways of computing one document
    (another row length, so another BLAS blocking) can flip a rounding, and the flip grows through
    the layers. In float64 such a flip needs a value within ~1e-16 of a rounding boundary."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and t.dtype != fp8.FP8:
            t.data = t.data.double()
    return model


def assert_documents_apart(target: Path, layers: list[int], tol: float) -> None:
    """extract's per-row capture on a row of three documents and padding: each document's features
    (and last hidden state) equal its features captured alone within ``tol`` (relative); the same
    tokens as one document differ by far more. In float64 (:func:`in_float64`)."""
    model, _ = load_target(str(target), "cpu", "float32", "sdpa")
    capture = FeatureCapture(in_float64(model), layers, last_hidden=True)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5999, n) for n in DOCS]
    packed = capture.capture_row(packed_row(docs, pad=PAD))
    alone = [capture.capture_row(packed_row([d])) for d in docs]
    joined = capture.capture_row(packed_row([np.concatenate(docs)]))
    assert packed[0].shape == (sum(DOCS) + PAD, len(layers) * H) and packed[0].dtype == torch.float64
    assert torch.isfinite(packed[0]).all()
    start = 0
    for n, (features, last_hidden) in zip(DOCS, alone):
        span = slice(start, start + n)
        assert rel(packed[0][span], features) <= tol, start
        assert rel(packed[1][span], last_hidden) <= tol, start
        start += n
    later = slice(DOCS[0], sum(DOCS))
    assert rel(joined[0][later], packed[0][later]) > 1e-2


def test_dense_fp8_features_keep_documents_apart(dense: tuple[Path, Path, list[str]]) -> None:
    assert_documents_apart(dense[1], [0, 1], tol=1e-9)


@needs_hybrid
@hybrid_on_cpu
@pytest.mark.parametrize("hybrid", ["text"], indirect=True)
def test_hybrid_fp8_features_keep_documents_apart(hybrid: tuple[Path, Path, list[str]]) -> None:
    assert_documents_apart(hybrid[1], [0, 2], tol=1e-9)


def features(model: nn.Module, layers: list[int], row: dict) -> torch.Tensor:
    return FeatureCapture(model, layers).capture_row(row)[0]


@needs_hybrid
@hybrid_on_cpu
@pytest.mark.parametrize("hybrid", ["text"], indirect=True)
def test_fp8_features_against_the_same_weights(dense: tuple[Path, Path, list[str]],
                                               hybrid: tuple[Path, Path, list[str]]) -> None:
    """Per feature layer, relative error (max-abs, and RMS) of FP8 features against the features of
    the same (dequantized) weights without FP8 products, and against the unquantized weights,
    printed; only sanity is asserted (not zero, not garbage). Random weights have no outliers: one
    product already errs ~3.6% (RMS, the e4m3 rounding of both operands), and layers compound it."""
    rng = np.random.default_rng(3)
    row = packed_row([rng.integers(0, 5999, n) for n in (60, 36)])
    for kind, (float_dir, fp8_dir, _), layers in (("dense", dense, [0, 1]), ("hybrid", hybrid, [0, 2])):
        quantized, _ = load_target(str(fp8_dir), "cpu", "float32", "sdpa")
        same, _ = load_target(str(fp8_dir), "cpu", "float32", "sdpa")
        fp8.dequantize_model(same, torch.float32)
        original, _ = load_target(str(float_dir), "cpu", "float32", "sdpa")
        got = features(quantized, layers, row)
        against = {"same weights": features(same, layers, row), "unquantized": features(original, layers, row)}
        for i, t in enumerate(layers):
            cols = slice(i * H, (i + 1) * H)
            for what, ref in against.items():
                err = rel(got[:, cols], ref[:, cols])
                rms = float((got[:, cols] - ref[:, cols]).norm() / ref[:, cols].norm())
                print(f"\n{kind} layer {t}: FP8 vs {what}: max {err:.4f}, rms {rms:.4f}", end="")
                assert 0 < rms < 0.5  # random weights: ~4% per product compounds (see below)


# --- presets ---------------------------------------------------------------------------------------

def test_fp8_presets_are_the_random_weights_quantized() -> None:
    """``random:tiny-fp8`` is ``random:tiny`` with its linear layers (not the LM head) quantized."""
    plain, _ = load_target("random:tiny", "cpu", "float32", "sdpa")
    quantized, _ = load_target("random:tiny-fp8", "cpu", "float32", "sdpa")
    layers = fp8_layers(quantized)
    assert len(layers) == 8 * 7 and type(quantized.lm_head) is nn.Linear
    for name, layer in layers.items():
        q, scale = fp8.quantize_blocks(plain.get_submodule(name).weight)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, scale)
    ids = torch.arange(10)[None]
    assert quantized(input_ids=ids).logits.shape == plain(input_ids=ids).logits.shape


@needs_hybrid
def test_the_27b_fp8_preset_at_its_shape() -> None:
    """``random:qwen3.6-27b-fp8`` (built on the meta device): what Qwen3.6-27B-FP8 quantizes is fp8
    in 128x128 blocks, the rest keeps the bf16 preset's shapes; plan reads its hidden size."""
    from dflash_stages.extract import ExtractConfig
    from dflash_stages.layout.measure import feature_dims

    model, _ = load_target("random:qwen3.6-27b-fp8", device="meta", dtype="bfloat16")
    plain, _ = load_target("random:qwen3.6-27b", device="meta", dtype="bfloat16")
    layers = fp8_layers(model)
    assert len(layers) == 48 * (3 + 3) + 16 * (4 + 3)
    assert not [n for n in layers if "in_proj_a" in n or "in_proj_b" in n]
    up = layers["model.layers.0.mlp.up_proj"]
    assert up.weight.dtype == fp8.FP8 and up.weight.shape == (17408, 5120)
    assert up.weight_scale_inv.shape == (136, 40) and up.weight_scale_inv.dtype == torch.float32
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert {n: tuple(p.shape) for n, p in model.named_parameters() if "weight_scale_inv" not in n} == shapes
    assert PRESETS["qwen3.6-27b-fp8"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert feature_dims(ExtractConfig(model="random:qwen3.6-27b-fp8")) == (5120, 5)


def test_evaluate_judges_an_fp8_target_at_fp8_rounding(dense: tuple[Path, Path, list[str]]) -> None:
    """evaluate's lossless check tolerates near ties by the target's dtype (float32: 1e-4), and for a
    target with FP8 layers at least at e4m3's rounding step, 2^-3 (an FP8 SmolLM2 left its greedy
    decode at up to 1.1% of the logit in float32 on the CPU, 11.3% in bf16 on the H200)."""
    from dflash_stages.evaluate import runs

    float_dir, fp8_dir, saved = dense
    unquantized, _ = load_target(str(float_dir), "cpu", "float32", "sdpa")
    quantized, _ = load_target(str(fp8_dir), "cpu", "float32", "sdpa")
    assert runs.fp8_layers(unquantized) == 0 and runs.tie_tolerance(unquantized) == 1e-4
    assert runs.fp8_layers(quantized) == len(saved) and runs.tie_tolerance(quantized) == runs.FP8_TIE_TOLERANCE


@needs_smollm2
def test_the_fp8_tolerance_still_catches_a_loop_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M quantized to the block format, float32 on the CPU, three held-out prompts, 16
    tokens with the n-gram drafter: the loop as it is leaves HF's greedy decode only at near ties (the
    FP8 rounding); a loop that accepts one draft too many leaves it at mismatches whose logit gaps are
    over twice their tolerance (measured: 38-49% of the logit against 2^-3), so the wide FP8
    tolerance still fails a real logic error. The n-gram drafter's wrong drafts are far from the
    target's choice; a trained drafter's are nearer, so this bounds what the check catches, it does
    not prove it catches every loop error at FP8's tolerance."""
    pytest.importorskip("gguf", reason="transformers needs the 'gguf' package to read GGUF")
    import dflash_model.target.spec_decode as sd
    from dflash_model.target.smollm2 import load_smollm2
    from dflash_stages.evaluate import runs

    model, tok = load_smollm2(dtype=torch.float32)
    fp8.quantize_model(model)
    tol = runs.tie_tolerance(model)
    assert tol == runs.FP8_TIE_TOLERANCE
    records = [json.loads(line) for line in (DATA / "heldout.jsonl").read_text(encoding="utf-8").splitlines()[:3]]
    prompts = [tok.apply_chat_template(r["messages"][:1], tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for r in records]
    eos, new_tokens = {tok.eos_token_id}, 16
    refs = runs.hf_greedy(model, prompts, new_tokens, eos, tok.pad_token_id)

    def judged() -> tuple[list[dict], list[dict]]:
        outputs = [sd.speculative_decode(model, p, sd.ngram_drafter(), 4, new_tokens, None, eos).tokens
                   for p in prompts]
        return runs.check_outputs(model, prompts, refs, outputs, "ngram", tol)

    assert judged()[0] == []
    real = sd.accepted_prefix
    monkeypatch.setattr(sd, "accepted_prefix", lambda drafts, target: min(len(drafts), real(drafts, target) + 1))
    planted, ties = judged()
    assert len(planted) == len(prompts) and ties == []  # every prompt fails, none passes as a near tie
    assert all(m["logit_gap"] > 2 * m["tolerance"] for m in planted)
