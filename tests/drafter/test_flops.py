import pytest

from dflash_model.drafter import DrafterConfig, training_flops


def _cfg(**kw):
    d = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=36, vocab_size=151936, rope_theta=1e6)
    return DrafterConfig.from_target(d, num_layers=5, block_size=16, mask_token_id=151669, **kw)


def test_flop_model_terms_by_hand():
    cfg = DrafterConfig.from_target(dict(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=4, num_hidden_layers=8, vocab_size=10),
                                    num_layers=2, block_size=3, mask_token_id=9, target_layer_ids=[1, 2, 3])
    f = training_flops(cfg, num_tokens=5, num_anchors=2, attended_pairs=7)
    # T=5, N=2, B=3, Q=6, F=24, H=8, nh=2, nkv=1, d=4, I=16, V=10, layers=2, P=7
    assert f["fc"] == 2 * 5 * 24 * 8
    assert f["ctx_kv"] == 2 * 2 * 5 * 8 * (2 * 1 * 4)
    assert f["block"] == 2 * 2 * 6 * (8 * 2 * 4 + 8 * 2 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16)
    assert f["attn"] == 2 * 4 * 2 * 4 * 7
    assert f["lm_head"] == 2 * 2 * 2 * 8 * 10
    assert f["step"] == 3 * (f["fc"] + f["ctx_kv"] + f["block"] + f["attn"]) + 2 * f["lm_head"]
    assert training_flops(cfg, 5, 2, [7, 7]) == f
    assert training_flops(cfg, 5, 2, 7, lm_head_rows=3)["lm_head"] == 2 * 3 * 8 * 10
    with pytest.raises(ValueError):
        training_flops(cfg, 5, 2, [7])


def test_flop_model_qwen3_8b_reference_step_is_about_76_tflop():
    # 8192-token row, 512 anchors, B=16; P: each query sees its block (16) + ~1/2 of a 2731-token document
    P = 512 * 16 * (16 + 2731 // 2)
    step = training_flops(_cfg(), 8192, 512, P)["step"]
    assert 74e12 < step < 78e12  # docs/benchmarks.md, 'Reference figures': 76.2 TFLOP for this configuration
