"""Batched speculative decoding (masked, never cropped KV slots): every row is its prompt's greedy
decode, with the same cycles as the per-prompt loop, and its drafter sees exactly the features of
its verified tokens."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_model.target.capture import FeatureCapture
from dflash_model.target.spec_batch import one_by_one, speculative_decode_batch
from dflash_model.target.spec_decode import DraftRequest, greedy_decode, ngram_drafter, oracle_drafter, speculative_decode
from tests.stages.test_evaluate import B, target  # noqa: F401 (the fixture)

LAYERS = [0, 1]

@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(100) for _ in range(n)] for n in (5, 9, 3, 14)]


def _drafters(prompts, refs):
    """name -> per-request drafter (stateless, so per-prompt and batched runs see the same one)."""
    def oracle(req: DraftRequest) -> list[int]:
        row = next(i for i, p in enumerate(prompts) if req.tokens[:len(p)] == list(p))
        return oracle_drafter(list(prompts[row]) + refs[row], len(prompts[row]))(req)

    def random_tokens(req: DraftRequest) -> list[int]:
        rng = random.Random(len(req.tokens))
        return [rng.randrange(128) for _ in range(req.max_tokens)]

    return {"wrong": lambda r: [127] * r.max_tokens, "random": random_tokens, "oracle": oracle,
            "half": lambda r: oracle(r)[:len(r.tokens) % 3] + [127] * r.max_tokens, "ngram": ngram_drafter()}


def test_rows_equal_the_per_prompt_loop_and_greedy(target, prompts):
    refs = [greedy_decode(target, p, 21) for p in prompts]
    for name, drafter in _drafters(prompts, refs).items():
        batch = speculative_decode_batch(target, prompts, one_by_one(drafter), B, 21, LAYERS)
        for p, ref, got in zip(prompts, refs, batch):
            alone = speculative_decode(target, p, drafter, B, 21, LAYERS)
            assert got.tokens == ref, name
            assert (got.accepted, got.drafted, got.budget, got.anchors) == \
                (alone.accepted, alone.drafted, alone.budget, alone.anchors), name


def test_clock_splits_the_seconds_into_drafting_and_verifying(target, prompts):
    """Both loops add each drafter call's seconds to ``draft`` and the target's forwards' to
    ``verify``; the tokens are those of a run without a clock."""
    import time

    calls: list[int] = []

    def slow_ngram(req: DraftRequest) -> list[int]:
        calls.append(1)
        time.sleep(0.01)
        return ngram_drafter()(req)

    for decode in ("batch", "per prompt"):
        calls.clear()
        clock: dict[str, float] = {}
        t0 = time.perf_counter()
        if decode == "batch":
            got = speculative_decode_batch(target, prompts, one_by_one(slow_ngram), B, 12, None, clock=clock)
        else:
            got = [speculative_decode(target, p, slow_ngram, B, 12, None, clock=clock) for p in prompts]
        total = time.perf_counter() - t0
        plain = [speculative_decode(target, p, ngram_drafter(), B, 12, None).tokens for p in prompts]
        assert [r.tokens for r in got] == plain, decode
        assert set(clock) == {"draft", "verify"}, decode
        assert clock["draft"] >= 0.01 * len(calls) > 0 and clock["verify"] > 0, decode
        assert clock["draft"] + clock["verify"] <= total, decode


def test_both_loops_draft_and_verify_without_autograd(target, prompts):
    """A decode is a measurement: neither loop lets its drafter or the target record a graph, with
    a clock (whose context manager wraps each phase) or without."""
    grad_on: list[bool] = []

    def watching(req: DraftRequest) -> list[int]:
        grad_on.append(torch.is_grad_enabled())
        return ngram_drafter()(req)

    hook = target.register_forward_hook(lambda m, args, out: grad_on.append(torch.is_grad_enabled()))
    try:
        for clock in (None, {}):
            speculative_decode_batch(target, prompts, one_by_one(watching), B, 8, None, clock=clock)
            for p in prompts:
                speculative_decode(target, p, watching, B, 8, None, clock=clock)
    finally:
        hook.remove()
    assert grad_on and not any(grad_on)


def test_eos_and_max_new_tokens_end_rows_independently(target, prompts):
    refs = [greedy_decode(target, p, 16) for p in prompts]
    eos = refs[1][4]
    batch = speculative_decode_batch(target, prompts, one_by_one(ngram_drafter()), B, 16, None, eos_token_id=[eos])
    for p, got in zip(prompts, batch):
        assert got.tokens == greedy_decode(target, p, 16, eos_token_id=eos)
    assert len(batch[1].tokens) == 5


def test_drafter_sees_the_features_of_exactly_the_verified_tokens(target, prompts):
    cap = FeatureCapture(target, LAYERS)
    refs = [greedy_decode(target, p, 16) for p in prompts]
    seen: list[DraftRequest] = []
    half = _drafters(prompts, refs)["half"]

    def drafter(reqs: list[DraftRequest]) -> list[list[int]]:
        seen.extend(DraftRequest(r.features.clone(), r.positions.clone(), list(r.tokens), r.last_token,
                                 r.last_position, r.max_tokens) for r in reqs)
        return [half(r) for r in reqs]

    batch = speculative_decode_batch(target, prompts, drafter, B, 16, LAYERS)
    assert [r.tokens for r in batch] == refs and len(seen) > 8
    for req in seen:
        ctx = req.tokens[:-1]
        assert req.features.shape[0] == len(ctx) == req.last_position
        full, _ = cap.capture(torch.tensor([ctx]))
        torch.testing.assert_close(req.features, full[0], atol=1e-5, rtol=1e-4)


def test_bf16_check_passes_the_loop_and_fails_a_planted_acceptance_bug(tmp_path_factory, monkeypatch):
    """In bf16 the batched loop may leave the greedy decode only at near ties (tolerated, reported);
    accepting one draft too many puts a token far below the target's choice there: a failure."""
    import transformers

    import dflash_model.target.spec_decode as sd
    from dflash_stages.evaluate.runs import TIE_TOLERANCE, check_outputs, decode_all, reference_decode
    from tests.stages.online_fixtures import tiny_target

    path = tiny_target(tmp_path_factory.getbasetemp(), layers=2, hidden=32, vocab=151936, initializer_range=0.5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (6, 11, 4, 9)]
    refs, _ = reference_decode(model, prompts, 24, set(), 0, batch_size=4)

    def half(req: DraftRequest) -> list[int]:
        row = next(i for i, p in enumerate(prompts) if req.tokens[:len(p)] == p)
        good = refs[row][len(req.tokens) - len(prompts[row]):]
        return (good[:len(req.tokens) % 3] + [5] * req.max_tokens)[:req.max_tokens]

    tol = TIE_TOLERANCE[torch.bfloat16]
    run = decode_all(model, prompts, half, B, 24, None, set(), batch_size=4)
    mismatches, ties = check_outputs(model, prompts, refs, run.tokens, "half", tol)
    assert mismatches == [] and len(ties) < len(prompts)
    assert sum(r.accepted.count(0) < len(r.accepted) for r in run.results) > 0  # drafts were accepted

    real = sd.accepted_prefix
    monkeypatch.setattr(sd, "accepted_prefix", lambda d, t: min(len(d), real(d, t) + 1))
    bad = decode_all(model, prompts, half, B, 24, None, set(), batch_size=4)
    mismatches, _ = check_outputs(model, prompts, refs, bad.tokens, "half", tol)
    assert len(mismatches) == len(prompts)
    assert all(m["logit_gap"] > m["tolerance"] for m in mismatches)
