import pytest
import torch
import transformers
from conftest import qwen3_config

from dflash_model.drafter import DFlashDrafter, DrafterConfig, default_gamma, pick_mask_token_id
from dflash_model.drafter.rope import rope_inv_freq


def test_reads_qwen3_config_object_and_dict():
    c = qwen3_config(rms_norm_eps=1e-5)
    for src in (c, c.to_dict()):
        cfg = DrafterConfig.from_target(src, num_layers=3, block_size=16, mask_token_id=63)
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.head_dim, cfg.rms_norm_eps, cfg.vocab_size, cfg.num_target_layers) == (32, 48, 4, 2, 8, 1e-5, 64, 8)
        assert cfg.target_layer_ids == [1, 3, 5]  # round(1 + i*(8-4)/2)
        assert cfg.layer_types == ["full_attention"] * 3 and cfg.sliding_window is None
        assert cfg.rope_parameters("full_attention")["rope_type"] == "default"


def test_head_dim_defaults_to_hidden_over_heads_and_text_config_is_used():
    d = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_hidden_layers=12, vocab_size=100,
             rope_theta=1e6)
    cfg = DrafterConfig.from_target({"text_config": d, "architectures": ["X"]}, mask_token_id=99)
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 8
    assert cfg.rope == {"rope_theta": 1e6} and cfg.rope_parameters("full_attention")["rope_theta"] == 1e6


def test_mask_token_id_required_and_in_range():
    with pytest.raises(ValueError):
        DFlashDrafter(qwen3_config())
    with pytest.raises(ValueError):
        DFlashDrafter(qwen3_config(), mask_token_id=64)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 5e5,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.0},
])
def test_rope_matches_transformers_qwen3(rope):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    c = qwen3_config(rope_parameters=dict(rope))
    ref = Qwen3RotaryEmbedding(c)
    cfg = DrafterConfig.from_target(c, num_layers=2, mask_token_id=63)
    inv, scale = rope_inv_freq(cfg.rope_parameters("full_attention"), cfg.head_dim)
    torch.testing.assert_close(inv, ref.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref.attention_scaling)


def test_llama3_rope_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=8, vocab_size=100, max_position_embeddings=8192,
                                 rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                                  "rope_theta": 5e5})
    cfg = DrafterConfig.from_target(c, num_layers=2, mask_token_id=99)
    assert cfg.head_dim == 16 and cfg.hidden_act == "silu"
    inv, scale = rope_inv_freq(cfg.rope_parameters("full_attention"), cfg.head_dim)
    ref = LlamaRotaryEmbedding(c)
    torch.testing.assert_close(inv, ref.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == 1.0
    assert cfg.to_export_dict()["rope_parameters"] == c.to_dict()["rope_parameters"]


def test_v4_style_rope_fields_are_read_and_exported_for_v4_and_v5():
    d = qwen3_config().to_dict()
    del d["rope_parameters"]
    d.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = DrafterConfig.from_target(d, num_layers=2, mask_token_id=63)
    p = cfg.rope_parameters("full_attention")
    assert (p["rope_type"], p["rope_theta"], p["factor"]) == ("linear", 1e6, 2.0)
    out = cfg.to_export_dict()
    assert out["rope_theta"] == 1e6 and out["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert out["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert DrafterConfig.from_export_dict(out).rope_parameters("full_attention") == out["rope_parameters"]


def test_layer_types_with_different_rope_are_not_exported():
    d = qwen3_config(use_sliding_window=True, sliding_window=16, max_window_layers=1).to_dict()
    d["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="different RoPE"):
        DrafterConfig.from_target(d, num_layers=2, mask_token_id=63).to_export_dict()
    one_type = DrafterConfig.from_target(d, num_layers=1, mask_token_id=63).to_export_dict()
    assert (one_type["rope_theta"], one_type["layer_types"]) == (1e6, ["full_attention"])


def test_nested_per_layer_type_rope_parameters():
    d = qwen3_config(use_sliding_window=True, sliding_window=16, max_window_layers=1).to_dict()
    d["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = DrafterConfig.from_target(d, num_layers=2, mask_token_id=63)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    assert cfg.rope_parameters("full_attention")["rope_theta"] == 1e6
    assert cfg.rope_parameters("sliding_attention")["rope_theta"] == 1e4


def test_layer_types_follow_target_pattern_or_explicit():
    c = qwen3_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert c.layer_types[:3] == ["full_attention", "sliding_attention", "sliding_attention"]
    cfg = DrafterConfig.from_target(c, num_layers=3, mask_token_id=63)
    assert cfg.layer_types == c.layer_types[:3] and cfg.sliding_window == 16
    d = qwen3_config().to_dict()
    d["layer_types"] = ["linear_attention", "full_attention"] * 4  # hybrid targets: no linear draft layers
    assert DrafterConfig.from_target(d, num_layers=3, mask_token_id=63).layer_types == ["full_attention"] * 3
    cfg = DrafterConfig.from_target(c, num_layers=2, mask_token_id=63, layer_types=["sliding_attention"] * 2)
    assert cfg.layer_types == ["sliding_attention"] * 2
    with pytest.raises(ValueError):
        DrafterConfig.from_target(qwen3_config(), num_layers=2, mask_token_id=63, layer_types=["sliding_attention"] * 2)


def test_pick_mask_token_id():
    assert pick_mask_token_id(151936, 151669) == 151669  # Qwen3: first unused embedding row
    assert pick_mask_token_id(10, {0, 1, 2, 4}) == 3
    with pytest.raises(ValueError):
        pick_mask_token_id(10, 10)
    with pytest.raises(ValueError):
        pick_mask_token_id(3, [0, 1, 2])


def test_default_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == 3.0
