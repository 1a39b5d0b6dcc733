"""Speculative decoding and evaluate on a hybrid target (docs/hybrid_targets.md): a tiny random Qwen3.5 text model,
three Gated DeltaNet layers and one full-attention layer, fp32 on CPU.

The linear layers' conv and recurrent state must be rolled back when drafts are rejected; the
lossless check (output == the target's own greedy decode) is what proves it, so one test plants a
rollback that skips the restore and checks that evaluate reports the divergence.
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash_model.target import spec_cache
from dflash_model.target.capture import FeatureCapture
from dflash_model.target.spec_decode import (DraftRequest, greedy_decode, ngram_drafter, oracle_drafter,
                                       speculative_decode)
from tests.stages.test_evaluate import tiny_qwen3
from tests.stages.test_ngram_split import assert_split_adds_up
from tests.transformers_versions import needs_hybrid

B, V = 4, 128
LAYER_IDS = [0, 3]  # a linear layer and the full-attention layer (the last layer, 4, is not readable)


def tiny_qwen3_5(seed: int = 0):
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(V - 1) for _ in range(n)] for n in (5, 9, 70)]  # 70: prefill over a 64-chunk


def _mixed(prompt: list[int], ref: list[int]):
    """Right for the first 0, 1, 2 or 3 slots of successive cycles, wrong after: every tau 1..B occurs."""
    oracle = oracle_drafter(list(prompt) + ref, len(prompt))
    calls = [0]

    def draft(req: DraftRequest) -> list[int]:
        calls[0] += 1
        good = oracle(req)[:calls[0] % B]
        return good + [V - 1] * (req.max_tokens - len(good))

    return draft


@needs_hybrid
def test_lossless_on_hybrid_target(hybrid, prompts):
    for prompt in prompts:
        ref = greedy_decode(hybrid, prompt, 24)
        rng = random.Random(len(prompt))
        rand = speculative_decode(hybrid, prompt, lambda r: [rng.randrange(V) for _ in range(r.max_tokens)],
                                  B, 24, LAYER_IDS)
        assert rand.tokens == ref
        mixed = speculative_decode(hybrid, prompt, _mixed(prompt, ref), B, 24, LAYER_IDS)
        assert mixed.tokens == ref
        assert {t for t, d in zip(mixed.taus, mixed.drafted) if d == B - 1} == {1, 2, 3, B}
        oracle = speculative_decode(hybrid, prompt, oracle_drafter(list(prompt) + ref, len(prompt)), B, 24, [1])
        assert oracle.tokens == ref
        assert oracle.drafted == [3] * 5 + [2] and oracle.taus == [B] * 5 + [3]
        assert speculative_decode(hybrid, prompt, ngram_drafter(), B, 24).tokens == ref


@pytest.mark.parametrize("kind", ["dense", pytest.param("hybrid", marks=needs_hybrid)])
def test_rerun_only_on_hybrid_rejections(kind, prompts, request):
    """A dense target runs once per cycle; a hybrid one runs the kept tokens again only in cycles
    that rejected a draft (fully accepted blocks leave the state as it should be)."""
    model = request.getfixturevalue("hybrid") if kind == "hybrid" else tiny_qwen3()
    prompt = prompts[1]
    ref = greedy_decode(model, prompt, 24)
    calls: list[int] = []
    handle = model.register_forward_hook(lambda _m, args, kw, _o: calls.append(kw["input_ids"].shape[1]),
                                         with_kwargs=True)
    try:
        res = speculative_decode(model, prompt, _mixed(prompt, ref), B, 24, [0])
    finally:
        handle.remove()
    assert res.tokens == ref
    rejected = [n + 1 for n, d in zip(res.accepted, res.drafted) if n < d]
    assert rejected and len(rejected) < res.cycles
    verify = [d + 1 for d in res.drafted]
    if kind == "dense":
        assert calls == [len(prompt)] + verify
    else:
        expected = [len(prompt)]
        for d, n in zip(res.drafted, res.accepted):
            expected += [d + 1] + ([n + 1] if n < d else [])
        assert calls == expected


@needs_hybrid
def test_features_are_those_of_the_accepted_sequence(hybrid, prompts):
    """The drafter's context = an uncached forward's features of exactly the verified tokens, the
    training-time features, after rejected and after fully accepted blocks alike."""
    cap = FeatureCapture(hybrid, LAYER_IDS)
    prompt = prompts[0]
    ref = greedy_decode(hybrid, prompt, 20)
    mixed = _mixed(prompt, ref)
    seen: list[DraftRequest] = []

    def drafter(req: DraftRequest) -> list[int]:
        seen.append(DraftRequest(req.features.clone(), req.positions.clone(), list(req.tokens), req.last_token,
                                 req.last_position, req.max_tokens))
        return mixed(req)

    res = speculative_decode(hybrid, prompt, drafter, B, 20, LAYER_IDS)
    assert res.tokens == ref and B in res.taus and 1 in res.taus
    for req in seen:
        ctx = req.tokens[:-1]
        assert req.features.shape[0] == len(ctx) == req.last_position
        full, _ = cap.capture(torch.tensor([ctx]))
        torch.testing.assert_close(req.features, full[0], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def hybrid_export(hybrid, tmp_path_factory):
    from dflash_model.drafter import DFlashDrafter, export_drafter

    torch.manual_seed(1)
    drafter = DFlashDrafter(hybrid.config, num_layers=1, block_size=B, target_layer_ids=LAYER_IDS,
                            mask_token_id=V - 1)
    return export_drafter(drafter, tmp_path_factory.mktemp("hybrid") / "export")


@needs_hybrid
def test_evaluate_export_lossless_on_hybrid(hybrid, hybrid_export, prompts):
    from dflash_stages.evaluate.export import evaluate_export

    rep = evaluate_export(hybrid_export, prompts=prompts[:2], max_new_tokens=12, loaded_target=(hybrid, None),
                          plot=False)
    assert rep["lossless"] is True and rep["mismatches"] == []
    assert all(row["lossless"] for row in rep["per_prompt"])
    assert rep["generated_tokens"] == 24 and rep["cycles"] > 0 and rep["ngram"]["cycles"] > 0
    assert rep["tau_sim"] is not None
    assert_split_adds_up(rep)


@needs_hybrid
def test_planted_broken_rollback_is_caught(hybrid, hybrid_export, prompts, monkeypatch):
    """Crop-only rollback (the state restore skipped): the outputs diverge from greedy and the lossless
    check reports it."""
    from dflash_stages.evaluate.export import evaluate_export

    monkeypatch.setattr(spec_cache, "restore", lambda layers, saved: None)
    rep = evaluate_export(hybrid_export, prompts=prompts[:2], max_new_tokens=12, loaded_target=(hybrid, None),
                          plot=False)
    assert rep["lossless"] is False
    assert "dflash" in {m["drafter"] for m in rep["mismatches"]}
    assert any(w.startswith("NOT LOSSLESS") for w in rep["warnings"])


@needs_hybrid
def test_combined_kv_and_linear_layers_are_refused():
    from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

    assert spec_cache.linear_state_layers(Cache(layers=[DynamicLayer()])) == []
    lin = LinearAttentionLayer()
    assert spec_cache.linear_state_layers(Cache(layers=[lin, DynamicLayer()])) == [lin]
    with pytest.raises(NotImplementedError, match="LinearAttentionAndFullAttentionLayer"):
        spec_cache.linear_state_layers(Cache(layers=[LinearAttentionAndFullAttentionLayer()]))
