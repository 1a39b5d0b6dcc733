"""The drafter train:dflash builds: the published shape for the Qwen3.5/3.6 family by default, the
target's own attention for other targets, explicit overrides, and ``init_from`` an export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_core import StageContext
from dflash_core.config_types import validate_params
from dflash_model.drafter import DFlashDrafter, export_drafter, load_drafter
from dflash_model.drafter.config import FULL
from dflash_model.target.features import feature_layer_ids
from dflash_stages.extract import ExtractConfig
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.drafter_init import drafter_config
from dflash_stages.train.trainer import Trainer

REAL_CONFIG = Path(__file__).parent / "data" / "qwen3_6_27b_config.json"

PUBLISHED_QWEN3_5_27B = {
    # z-lab's Qwen3.5-27B DFlash drafter config, as republished (docs/drafter.md, 'Attention shape for the target's family')
    "model_type": "qwen3", "num_hidden_layers": 5, "hidden_size": 5120, "intermediate_size": 17408,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e7,
    "max_position_embeddings": 262144, "vocab_size": 248320, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16},
}


def header(config: dict[str, Any], layer_ids: list[int], tokenizer_len: int | None = None,
           device: str = "cpu") -> dict[str, Any]:
    """What extract sends the trainer first, for a target config (random verifier weights)."""
    text = config.get("text_config", config)
    torch.manual_seed(0)
    embed = torch.randn(text["vocab_size"], text["hidden_size"], device=device)
    return {"kind": "target", "model": "test", "config": config, "target_layer_ids": layer_ids,
            "embed_weight": embed, "lm_head_weight": embed, "all_special_ids": [],
            "tokenizer_len": text["vocab_size"] - 1 if tokenizer_len is None else tokenizer_len}


def qwen3_6_header() -> dict[str, Any]:
    real = json.loads(REAL_CONFIG.read_text())
    cfg = ExtractConfig(model="Qwen/Qwen3.6-27B")  # the stage's defaults: layers auto, 5 features
    ids = feature_layer_ids(cfg.layers, cfg.num_features, real["text_config"]["num_hidden_layers"])
    return header(real, ids, tokenizer_len=248077, device="meta")  # 248,044 BPE + 33 special tokens


def tiny_qwen3(hidden: int = 32, layers: int = 4) -> dict[str, Any]:
    return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "vocab_size": 500, "max_position_embeddings": 4096,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6}


def tiny_qwen3_5_text() -> dict[str, Any]:
    real = json.loads(REAL_CONFIG.read_text())["text_config"]
    return dict(real, hidden_size=64, intermediate_size=128, num_hidden_layers=8, vocab_size=500,
                layer_types=real["layer_types"][:8])


def trainer(cfg: TrainConfig, head: dict[str, Any], tmp_path: Path) -> Trainer:
    ctx = StageContext(stage="train", config=cfg, device="cpu", run_dir=str(tmp_path),
                       work_dir=str(tmp_path))
    t = Trainer(cfg, ctx)
    t.setup(head)
    return t


def test_the_default_drafter_for_qwen3_6_27b_is_the_published_one() -> None:
    cfg, source = drafter_config(qwen3_6_header(), TrainConfig())
    exported = cfg.to_export_dict()
    assert {k: exported[k] for k in PUBLISHED_QWEN3_5_27B} == PUBLISHED_QWEN3_5_27B
    assert "partial_rotary_factor" not in json.dumps(exported)
    assert "mrope" not in json.dumps(exported)
    assert cfg.rope_parameters(FULL) == {"rope_theta": 1e7, "rope_type": "default"}
    assert source == "published (z-lab's Qwen3.5-27B DFlash drafter)"
    assert drafter_config(qwen3_6_header(), TrainConfig(drafter_shape="published"))[0] == cfg


def test_drafter_shape_target_copies_the_hybrid_targets_attention() -> None:
    cfg, source = drafter_config(qwen3_6_header(), TrainConfig(drafter_shape="target"))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    rope = cfg.rope_parameters(FULL)
    assert (rope["rope_theta"], rope["partial_rotary_factor"]) == (1e7, 0.25)
    assert cfg.mask_token_id == 248077  # the first row past the tokenizer's
    assert source == "the target's attention layer"


def test_an_explicit_mask_token_wins_over_the_published_one() -> None:
    cfg, _ = drafter_config(qwen3_6_header(), TrainConfig(mask_token_id=248075))
    assert cfg.mask_token_id == 248075 and cfg.num_attention_heads == 32


def test_a_dense_target_keeps_its_own_attention() -> None:
    head = header(tiny_qwen3(), [0, 2])
    cfg, source = drafter_config(head, TrainConfig(num_layers=1))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 8)
    assert cfg.rope_parameters(FULL)["rope_theta"] == 1e6 and cfg.mask_token_id == 499
    assert source == "the target's attention layer"
    with pytest.raises(ValueError, match="no published drafter for model_type 'qwen3'"):
        drafter_config(head, TrainConfig(drafter_shape="published"))


def test_drafter_attention_sets_a_small_shape_for_a_tiny_hybrid_target(tmp_path: Path) -> None:
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, compile="off",
                      drafter_attention={"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    t = trainer(cfg, header(tiny_qwen3_5_text(), [1, 3, 5]), tmp_path)
    c = t.model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_parameters(FULL) == {"rope_theta": 1e7, "rope_type": "default"}  # the published RoPE
    assert c.mask_token_id == 499  # the published mask token belongs to the 248,320-row table only
    assert t.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
    assert t.ctx.summary["drafter"] == "1 layers, 4 q / 2 kv heads x 16, MLP 128, rope_theta 1e+07, mask token 499"
    assert t.ctx.summary["drafter_source"] == \
        "published (z-lab's Qwen3.5-27B DFlash drafter) + drafter_attention"

    theta = drafter_config(header(tiny_qwen3_5_text(), [1, 3, 5]),
                           TrainConfig(drafter_shape="target", drafter_attention={"rope_theta": 5e5}))[0]
    assert theta.rope_parameters(FULL) == {"rope_theta": 5e5, "rope_type": "default"}
    assert theta.num_attention_heads == 24  # the target's, kept


def test_intermediate_size_sets_the_mlp_width_and_nothing_else(tmp_path: Path) -> None:
    head = header(tiny_qwen3(), [0, 2])
    base = drafter_config(head, TrainConfig(num_layers=1, block_size=4))[0]
    assert base.intermediate_size == 64  # the target's
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, compile="off", intermediate_size=96)
    t = trainer(cfg, head, tmp_path)
    c = t.model.config
    assert dataclasses.replace(c, intermediate_size=64) == base
    mlp = t.model.layers[0].mlp
    assert (mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) == \
        ((96, 32), (96, 32), (32, 96))
    assert c.to_export_dict()["intermediate_size"] == 96
    assert t.ctx.summary["drafter"] == "1 layers, 4 q / 2 kv heads x 8, MLP 96, rope_theta 1e+06, mask token 499"
    assert t.ctx.summary["drafter_source"] == "the target's attention layer + intermediate_size"
    _, errors = validate_params(TrainConfig, {"intermediate_size": 0})
    assert [m for _, m in errors] == ["invalid params: intermediate_size must be >= 1 (or null), got 0"]


def test_the_drafter_params_are_checked_in_the_pipeline_file() -> None:
    _, errors = validate_params(TrainConfig, {"drafter_shape": "publshed"})
    assert [m for _, m in errors] == [
        "param 'drafter_shape' must be one of 'auto', 'target', 'published', got str 'publshed' "
        "(did you mean 'published'?)"]
    _, errors = validate_params(TrainConfig, {"drafter_attention": {"num_attention_head": 4}})
    assert [m for _, m in errors] == [
        "unknown param 'drafter_attention.num_attention_head' "
        "(did you mean 'drafter_attention.num_attention_heads'?)"]
    cfg, errors = validate_params(TrainConfig, {"drafter_attention": {"head_dim": 64},
                                                "init_from": "s3://b/d"})
    assert errors == [] and cfg.drafter_attention.head_dim == 64 and cfg.init_from == "s3://b/d"


@pytest.fixture
def export(tmp_path: Path) -> Path:
    """An exported 1-layer drafter for a 4-layer, hidden-32 Qwen3 target (layers 0, 2; B = 4)."""
    cfg, _ = drafter_config(header(tiny_qwen3(), [0, 2]), TrainConfig(num_layers=1, block_size=4))
    torch.manual_seed(123)
    return Path(export_drafter(DFlashDrafter(cfg), tmp_path / "export"))


def test_init_from_starts_from_the_exported_weights(export: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(num_layers=1, block_size=4, compile="off", seed=7, init_from=str(export))
    t = trainer(cfg, header(tiny_qwen3(), [0, 2]), tmp_path / "run")
    want = load_drafter(export, dtype=torch.float32).state_dict()
    got = t.model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    seeded = trainer(TrainConfig(num_layers=1, block_size=4, compile="off", seed=7),
                     header(tiny_qwen3(), [0, 2]), tmp_path / "seeded").model.state_dict()
    assert not torch.equal(seeded["fc.weight"], got["fc.weight"])
    assert t.ctx.summary["drafter_source"] == f"init_from {export}"


def test_init_from_refuses_a_drafter_of_another_target_or_run(export: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(num_layers=2, block_size=8, compile="off", init_from=str(export))
    with pytest.raises(ValueError) as info:
        trainer(cfg, header(tiny_qwen3(hidden=64, layers=6), [1, 3]), tmp_path)
    assert str(info.value) == (
        f"init_from {export}: this drafter was made for another target or run shape: "
        "hidden_size: 32 in the export, 64 here (the target's); "
        "num_target_layers: 4 in the export, 6 here (the target's); "
        "target_layer_ids: [0, 2] in the export, [1, 3] here (extract's layers); "
        "block_size: 4 in the export, 8 here (train block_size); "
        "num_layers: 1 in the export, 2 here (train num_layers)")
    other_vocab = dict(tiny_qwen3(), vocab_size=600)
    with pytest.raises(ValueError, match=r"^init_from .*: vocab_size: 500 in the export, 600 here "
                                         r"\(the target's\)$"):
        trainer(TrainConfig(num_layers=1, block_size=4, compile="off", init_from=str(export)),
                header(other_vocab, [0, 2]), tmp_path)
    explicit_mask = TrainConfig(num_layers=1, block_size=4, compile="off", init_from=str(export),
                                mask_token_id=7)
    with pytest.raises(ValueError, match=r"mask_token_id: 499 in the export, 7 here \(train mask_token_id\)$"):
        trainer(explicit_mask, header(tiny_qwen3(), [0, 2]), tmp_path)
    wider = TrainConfig(num_layers=1, block_size=4, compile="off", init_from=str(export), intermediate_size=96)
    with pytest.raises(ValueError, match=r"intermediate_size: 64 in the export, 96 here \(train intermediate_size\)$"):
        trainer(wider, header(tiny_qwen3(), [0, 2]), tmp_path)
    same = TrainConfig(num_layers=1, block_size=4, compile="off", init_from=str(export), intermediate_size=64)
    assert trainer(same, header(tiny_qwen3(), [0, 2]), tmp_path / "same").model.config.intermediate_size == 64
