import json
import os
from pathlib import Path

import fsspec

import pytest
import torch
from conftest import MASK_ID, make_drafter, packed_row

from dflash_model.drafter import (build_blocks, doc_ids_from_lengths, export_drafter, load_drafter, read_export_config,
                                 sample_anchors)
from dflash_model.drafter import export as export_mod

NAMES_2_LAYERS = [
    "fc.weight", "hidden_norm.weight", "norm.weight",
    "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight",
    "layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight",
    "layers.1.self_attn.o_proj.weight", "layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight",
    "layers.1.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight", "layers.1.mlp.down_proj.weight",
]
CONFIG_KEYS = [
    "architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "num_hidden_layers",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "layer_types",
    "sliding_window", "use_sliding_window", "attention_bias", "vocab_size", "tie_word_embeddings", "dtype", "auto_map",
    "dflash_pipe",
]


def _hidden(model, r, anchors):
    docs = doc_ids_from_lengths(r["doc_lengths"], 40)
    ids, pos, layout = build_blocks(r["input_ids"], r["position_ids"], docs, anchors, 4, MASK_ID)
    with torch.no_grad():
        return model(r["features"], ids, r["position_ids"], pos, layout, r["E"]) @ r["W"].T


def test_export_names_config_and_round_trip(tmp_path):
    from safetensors import safe_open

    model = make_drafter(dtype=torch.bfloat16)
    dest = tmp_path / "drafter"
    export_drafter(model, dest, {"target": "tiny-qwen3", "data": "unit-test"})
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(NAMES_2_LAYERS)
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
        assert f.get_tensor("fc.weight").shape == (32, 2 * 32)
    cfg = json.loads((dest / "config.json").read_text())
    assert list(cfg) == CONFIG_KEYS
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 5], "block_size": 4}
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (4, 8, 2, 64)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_act"]) == (32, 48, 4, 2, 8, "silu")
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (10000.0, None)
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["sliding_window"] is None
    assert cfg["use_sliding_window"] is False
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (cfg["attention_bias"], cfg["tie_word_embeddings"], cfg["dtype"]) == (False, False, "bfloat16")
    assert cfg["dflash_pipe"] == {"target": "tiny-qwen3", "data": "unit-test"}
    assert read_export_config(dest) == cfg

    loaded = load_drafter(dest, device="cpu", dtype=torch.bfloat16)
    r = packed_row(dtype=torch.bfloat16)
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 6, torch.Generator().manual_seed(0))
    assert torch.equal(_hidden(loaded, r, anchors), _hidden(model, r, anchors))
    assert loaded.config == model.config


def test_float32_model_round_trips_through_bf16(tmp_path):
    model = make_drafter(dtype=torch.float32, layer_types=["full_attention", "sliding_attention"],
                         config_kw=dict(use_sliding_window=True, sliding_window=5))
    export_drafter(model, tmp_path / "d")
    cfg = read_export_config(tmp_path / "d")
    assert "dflash_pipe" not in cfg and (cfg["sliding_window"], cfg["use_sliding_window"]) == (5, True)
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"]
    loaded = load_drafter(tmp_path / "d", dtype=torch.float32)
    r = packed_row(dtype=torch.float32)
    anchors = sample_anchors(r["loss_mask"], r["doc_lengths"], 6, torch.Generator().manual_seed(0))
    assert torch.equal(_hidden(loaded, r, anchors), _hidden(model.bfloat16().float(), r, anchors))


def test_llama_rope_fields_are_exported_and_reloaded(tmp_path):
    import transformers

    from dflash_model.drafter import DFlashDrafter

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256, "rope_theta": 5e5}
    c = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=8, vocab_size=64, max_position_embeddings=8192, rope_parameters=rope)
    model = DFlashDrafter(c, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    export_drafter(model, f"file://{tmp_path}/d")
    cfg = read_export_config(tmp_path / "d")
    assert cfg["rope_parameters"] == rope and cfg["rope_theta"] == 5e5  # transformers 5 / 4 read these
    assert cfg["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    loaded = load_drafter(tmp_path / "d", dtype=torch.float32)
    assert torch.equal(loaded._rope["full_attention"][0], model._rope["full_attention"][0])


def test_overwrite_is_atomic_and_leaves_no_temp_dirs(tmp_path, monkeypatch):
    dest = tmp_path / "d"
    export_drafter(make_drafter(), dest, {"step": 1})
    export_drafter(make_drafter(), dest, {"step": 2})
    assert read_export_config(dest)["dflash_pipe"] == {"step": 2}

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_mod, "_write_dir", boom)
    with pytest.raises(RuntimeError):
        export_drafter(make_drafter(), dest, {"step": 3})
    assert read_export_config(dest)["dflash_pipe"] == {"step": 2}
    assert os.listdir(tmp_path) == ["d"]


def test_fsspec_url_destination_round_trips():
    model = make_drafter(dtype=torch.bfloat16)
    export_drafter(model, "memory://exports/d", {"step": 7})
    assert read_export_config("memory://exports/d")["dflash_pipe"] == {"step": 7}
    with fsspec.open("memory://exports/d/modeling_dflash.py", "r") as f:
        assert f.read() == (Path(export_mod.__file__).parent / "hf_model.py").read_text()
    loaded = load_drafter("memory://exports/d", dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
