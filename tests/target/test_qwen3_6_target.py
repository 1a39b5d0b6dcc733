"""Qwen3.6-27B as a target: a composite (vision-language) checkpoint read through its text model.

The real config.json is used for parsing, layer discovery and layer ids (the 27B model is built on
the meta device, never allocated); tiny composite models of the same structure are built for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_model.target.features import feature_layer_ids
from dflash_model.target.layers import base_model, decoder_layers
from dflash_model.target.load import PRESETS, load_target
from dflash_stages.extract import ExtractConfig
from tests.assets import unpack_qwen3_tokenizer
from tests.conftest import REPO
from tests.transformers_versions import needs_hybrid

pytestmark = needs_hybrid
REAL_CONFIG = Path(__file__).parents[1] / "stages" / "data" / "qwen3_6_27b_config.json"


def tiny_composite_config(vision_depth: int = 6) -> dict:
    """A Qwen3_5ForConditionalGeneration config of the real one's structure, tiny; its vision tower
    has more blocks than the text model has layers."""
    real = json.loads(REAL_CONFIG.read_text())
    text = {k: v for k, v in real["text_config"].items() if k not in ("dtype", "eos_token_id")}
    text = dict(text, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, layer_types=real["text_config"]["layer_types"][:4],
                rope_parameters=dict(real["text_config"]["rope_parameters"], mrope_section=[1, 1, 0]))
    vision = dict(real["vision_config"], depth=vision_depth, hidden_size=32, intermediate_size=64,
                  num_heads=2, out_hidden_size=64)
    return dict(real, text_config=text, vision_config=vision)


def tiny_composite_model(vision_depth: int = 6) -> torch.nn.Module:
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    raw = tiny_composite_config(vision_depth)
    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration(AutoConfig.for_model(raw.pop("model_type"), **raw)).eval()


def test_random_with_the_real_config_builds_the_text_model_at_its_shape() -> None:
    model, tok = load_target(f"random:{REAL_CONFIG}", device="meta", dtype="bfloat16")
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "visual" in n]
    assert tok.vocab_size == 248320
    layers = decoder_layers(model)
    assert len(layers) == 64
    cfg = ExtractConfig(model=f"random:{REAL_CONFIG}")  # the stage's defaults: layers auto, 5 features
    assert feature_layer_ids(cfg.layers, cfg.num_features, model.config.num_hidden_layers) == [1, 16, 31, 46, 61]
    kinds = [model.config.layer_types[i] for i in range(64)]
    assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * 16
    embed = model.get_input_embeddings().weight
    assert tuple(embed.shape) == (248320, 5120)
    non_embedding = sum(p.numel() for p in model.parameters()) - 2 * embed.numel()  # untied
    assert round(non_embedding / 1e9, 2) == 24.35


def test_the_preset_is_the_real_config_text_model() -> None:
    real, _ = load_target(f"random:{REAL_CONFIG}", device="meta", dtype="bfloat16")
    preset, _ = load_target("random:qwen3.6-27b", device="meta", dtype="bfloat16")
    want, got = real.config.to_dict(), preset.config.to_dict()
    assert {k: got[k] for k in PRESETS["qwen3.6-27b"]} == {k: want[k] for k in PRESETS["qwen3.6-27b"]}
    assert got["layer_types"] == want["layer_types"]
    shapes = {n: tuple(p.shape) for n, p in real.named_parameters()}
    assert {n: tuple(p.shape) for n, p in preset.named_parameters()} == shapes


def test_random_with_a_composite_config_builds_and_runs_only_the_text_model(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_composite_config()))
    model, tok = load_target(f"random:{path}", device="cpu", dtype="float32")
    assert not [n for n, _ in model.named_parameters() if "visual" in n]
    assert tok.vocab_size == 300 and len(decoder_layers(model)) == 4
    logits = model(input_ids=torch.arange(10)[None]).logits
    assert logits.shape == (1, 10, 300)


def test_decoder_layers_of_a_composite_model_are_the_text_layers() -> None:
    model = tiny_composite_model(vision_depth=6)
    assert len(model.model.visual.blocks) == 6
    assert decoder_layers(model) is model.model.language_model.layers


def test_a_composite_checkpoint_loads_as_its_text_model(tmp_path: Path) -> None:
    """Only the language model is allocated, and it computes what the full model does on text."""
    full = tiny_composite_model()
    full.save_pretrained(tmp_path)
    unpack_qwen3_tokenizer(tmp_path)
    model, _ = load_target(str(tmp_path), device="cpu", dtype="float32", attn_implementation="sdpa")
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "visual" in n]
    text_params = sum(p.numel() for p in full.model.language_model.parameters()) \
        + full.lm_head.weight.numel()
    assert sum(p.numel() for p in model.parameters()) == text_params
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.no_grad():
        want = full(input_ids=ids, output_hidden_states=True)
        got = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(got.logits, want.logits)
    assert len(got.hidden_states) == len(want.hidden_states) == 5
    for g, w in zip(got.hidden_states, want.hidden_states):
        assert torch.equal(g, w)
    assert decoder_layers(model) is base_model(model).layers


def test_plan_reads_the_hidden_size_of_the_preset_and_the_real_config() -> None:
    from dflash_stages.layout.measure import feature_dims

    assert feature_dims(ExtractConfig(model="random:qwen3.6-27b")) == (5120, 5)
    assert feature_dims(ExtractConfig(model=f"random:{REAL_CONFIG}")) == (5120, 5)


def test_the_production_pipeline_file(cli) -> None:
    """pipelines/qwen3_6_27b.yaml is valid once its CUDA devices are replaced (this host has none),
    and is the production job: the FP8 checkpoint, target and drafter colocated on each GPU, the
    published drafter shape with both FP8 products."""
    import yaml

    path = REPO / "pipelines" / "qwen3_6_27b.yaml"
    res = cli("validate", path, "--set", "stages.extract.device=cpu", "--set", "stages.train.device=cpu")
    assert res.code == 0, res.text
    stages = yaml.safe_load(path.read_text())["stages"]
    tok = stages["tokenize"]["params"]
    assert (tok["tokenizer"], tok["thinking"], tok["max_len"]) == ("Qwen/Qwen3.6-27B", True, 8192)
    assert stages["extract"]["params"] == {"model": "/models/Qwen3.6-27B-FP8", "layers": "auto"}  # FP8: a directory
    devices = (stages["extract"]["device"], stages["train"]["device"])
    assert devices == ("cuda:{local_rank}", "cuda:{local_rank}")  # colocated: each GPU runs both
    train = stages["train"]["params"]
    assert (train["drafter_shape"], train["lm_head_dtype"], train["mlp_dtype"]) == ("published", "fp8", "fp8")
    assert stages["download"]["params"]["source"].startswith("s3://")
    assert stages["checkpoint"]["params"]["dest"].startswith("s3://")
