"""evaluate:spec_decode — the speculative decoding loop, the report, the stage and the command.

Loop tests run on token ids with a tiny random Qwen3 (small vocab); the stage/CLI tests use a tiny
Qwen3 with the real vocab size and the real Qwen3 tokenizer, saved to disk and loaded back the way
the command loads it, and a drafter exported with ``export_drafter``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path

import pytest
import torch

from dflash_model.target.capture import FeatureCapture
from dflash_model.target.spec_decode import (DraftRequest, first_mismatch, greedy_decode, ngram_drafter, ngram_propose,
                                       oracle_drafter, speculative_decode, tau_histogram)
from tests.assets import unpack_qwen3_tokenizer

B = 4


def tiny_qwen3(vocab: int = 128, layers: int = 3, seed: int = 0):
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_qwen3()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(100) for _ in range(n)] for n in (5, 9, 3)]


# ----------------------------------------------------------------------------- the loop

def test_lossless_for_any_drafter_wrong_drafter_gives_tau_1(target, prompts):
    layer_ids = [0, 1]
    for prompt in prompts:
        ref = greedy_decode(target, prompt, 20)
        assert len(ref) == 20
        wrong = speculative_decode(target, prompt, lambda r: [127] * r.max_tokens, B, 20, layer_ids)
        assert wrong.tokens == ref
        assert set(wrong.taus) == {1} and wrong.cycles == 19  # one token per cycle after the prefill token
        rng = random.Random(len(prompt))
        rand = speculative_decode(target, prompt, lambda r: [rng.randrange(128) for _ in range(r.max_tokens)],
                                  B, 20, layer_ids)
        assert rand.tokens == ref
        # a drafter proposing the right token sometimes, wrong afterwards
        half = oracle_drafter(list(prompt) + ref, len(prompt))
        mixed = speculative_decode(target, prompt, lambda r: half(r)[:1] + [127] * (r.max_tokens - 1), B, 20, layer_ids)
        assert mixed.tokens == ref and max(mixed.taus) == 2
        ng = speculative_decode(target, prompt, ngram_drafter(), B, 20)
        assert ng.tokens == ref


def test_oracle_drafter_accepts_every_full_block(target, prompts):
    for prompt in prompts:
        ref = greedy_decode(target, prompt, 23)
        res = speculative_decode(target, prompt, oracle_drafter(list(prompt) + ref, len(prompt)), B, 23, [1])
        assert res.tokens == ref
        full = [a + 1 for a, d in zip(res.accepted, res.drafted) if d == B - 1]
        assert full and all(t == B for t in full)
        # 1 prefill token + 5 full cycles of B = 21, then 1 draft (2 remaining) -> tau 2
        assert res.drafted == [3, 3, 3, 3, 3, 1] and res.taus == [4, 4, 4, 4, 4, 2]
        assert tau_histogram(res.accepted, B) == [0, 0, 1, 0, 5]


def test_features_kept_are_those_of_verified_tokens(target, prompts):
    """The context handed to the drafter = a fresh, uncached forward's features of exactly the
    verified tokens (rejected drafts' rows dropped, cache cropped)."""
    layer_ids = [0, 1]
    cap = FeatureCapture(target, layer_ids)
    prompt = prompts[1]
    ref = greedy_decode(target, prompt, 16)
    half = oracle_drafter(list(prompt) + ref, len(prompt))
    seen: list[DraftRequest] = []

    def drafter(req: DraftRequest) -> list[int]:
        seen.append(DraftRequest(req.features.clone(), req.positions.clone(), list(req.tokens), req.last_token,
                                 req.last_position, req.max_tokens))
        good = half(req)
        return good[:len(seen) % 3] + [127] * req.max_tokens  # 0, 1 or 2 accepted

    res = speculative_decode(target, prompt, drafter, B, 16, layer_ids)
    assert res.tokens == ref and len(seen) > 3
    for req in seen:
        ctx = req.tokens[:-1]
        assert req.features.shape[0] == len(ctx) == req.last_position
        assert req.positions.tolist() == list(range(len(ctx)))
        full, _ = cap.capture(torch.tensor([ctx]))
        torch.testing.assert_close(req.features, full[0], atol=1e-5, rtol=1e-4)


def test_eos_stops_both_decodes(target, prompts):
    prompt = prompts[0]
    ref = greedy_decode(target, prompt, 12)
    eos = ref[5]
    short = greedy_decode(target, prompt, 12, eos_token_id=eos)
    assert short == ref[:ref.index(eos) + 1]
    res = speculative_decode(target, prompt, oracle_drafter(list(prompt) + ref, len(prompt)), B, 12, [1],
                             eos_token_id=[eos])
    assert res.tokens == short


def test_ngram_propose_latest_longest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_propose(toks, 3) == [7, 8, 5]           # "2 3" -> latest earlier "2 3" is at 6
    assert ngram_propose([4, 5, 6, 4], 2) == [5, 6]      # 1-gram fallback
    assert ngram_propose([1, 2, 3], 3) == []             # no match
    assert ngram_propose(toks, 0) == []
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2


def test_gap_and_warnings():
    from dflash_stages.evaluate.drafter import add_warnings, compute_gap

    assert compute_gap(2.0, 4.0) == (0.5, True)
    assert compute_gap(3.7, 4.0)[1] is False
    assert compute_gap(2.0, None) == (None, False)
    rep = {"tau": 1.1, "tau_sim": 3.0, "gap": (3.0 - 1.1) / 3.0, "gap_flag": True, "gap_threshold": 0.1,
           "lossless": True, "training": {"tau_sim_train": 3.2}}
    add_warnings(rep)
    assert rep["warnings"][0].startswith("TRAIN/SERVE GAP") and rep["gap_train_flag"] is True
    assert rep["gap_val"] is None and len(rep["warnings"]) == 2
    # the validation walk: within the threshold of the served tau no line; beyond it one, signed
    for val, lines in ((1.0, 0), (0.98, 1), (1.25, 1)):
        rep = {"tau": 1.1 if val != 1.0 else 1.05, "lossless": True, "gap_threshold": 0.1,
               "training": {"tau_serve_val": val}}
        add_warnings(rep)
        assert rep["gap_val"] == pytest.approx((val - rep["tau"]) / rep["tau"])
        assert [ln for ln in rep["warnings"] if ln.startswith("val_tau_serve")] == (
            [f"val_tau_serve, the trainer's walk over its validation documents ({val:.2f}), vs served tau "
             f"{rep['tau']:.2f} ({rep['gap_val'] * 100:+.0f}% of it): the walk reads the training records' text, "
             "the served tau the target's greedy text (sampled records read lower), on other prompts"] if lines else [])


# ----------------------------------------------------------------------------- export, stage, CLI

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny real-vocab Qwen3 + tokenizer on disk, prompts/metrics files, and an exported drafter
    whose metadata records them (like the checkpoint stage writes)."""
    import transformers

    from dflash_model.drafter import DFlashDrafter, export_drafter

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("served")
    tdir = root / "target"
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    model.save_pretrained(tdir)
    unpack_qwen3_tokenizer(tdir)
    heldout = root / "heldout.jsonl"
    heldout.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"prompt": "Name a colour.", "completion": "Blue."},
        {"messages": [{"role": "user", "content": "unused third"}]},
    ]) + "\n")
    metrics = root / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s, "tau_sim": 1 + s / 100, "acc": 0.1,
                                           "tokens_per_s": 1000.0}) + "\n" for s in (10, 20, 30)))
    drafter = DFlashDrafter(cfg, num_layers=1, block_size=B, target_layer_ids=[0, 1], mask_token_id=151669)
    meta = {"target": str(tdir), "tokenizer": str(tdir), "thinking": False, "heldout": str(heldout),
            "metrics": str(metrics), "chat_template_kwargs": {}, "step": 30}
    export = Path(export_drafter(drafter, root / "ckpt" / "export", extra_metadata=meta))
    return {"root": root, "target": tdir, "export": export, "heldout": heldout, "metrics": metrics}


def test_cli_defaults_from_export(served, cli):
    out = served["root"] / "eval_cli"
    r = cli("evaluate", served["export"], "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
            "--out", out)
    assert r.code == 0, r.text
    rep = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 1000
    assert rep["lossless"] is True and rep["num_prompts"] == 2 and rep["block_size"] == B
    assert rep["identical"] == 2 and rep["near_ties"] == []  # fp32: the decodes agree token for token
    assert rep["target"] == str(served["target"]) and rep["step"] == 30
    for key in ("tau", "tau_ngram", "tau_sim", "tau_ref", "gap", "gap_flag", "tau_histogram", "drafted", "accepted",
                "per_prompt", "ngram", "ngram_split", "training", "warnings"):
        assert key in rep
    assert rep["tau_ref"] == pytest.approx(rep["tau"])  # the served outputs are the reference
    assert len(rep["tau_histogram"]) == B + 1 and sum(rep["tau_histogram"]) == rep["cycles"]
    assert rep["training"]["steps"] == 30 and rep["training"]["tau_sim_train"] == pytest.approx(1.3)
    assert rep["generated_tokens"] == 12 and rep["tau"] >= 1
    # the prompt is the chat template's generation prompt (thinking off: empty think block)
    assert rep["per_prompt"][0]["prompt_tokens"] > 5
    assert "speculative decoding" in r.out and "lossless" in r.out and "no n-gram match" in r.out


def test_cli_fails_on_a_planted_acceptance_bug(served, cli, monkeypatch):
    """A loop that accepts one draft too many (a real logic error) fails the check: the wrong token's
    logit is far below the target's choice, not a near tie."""
    import dflash_model.target.spec_decode as sd

    real = sd.accepted_prefix
    monkeypatch.setattr(sd, "accepted_prefix", lambda drafts, target: min(len(drafts), real(drafts, target) + 1))
    out = served["root"] / "eval_bad"
    r = cli("evaluate", served["export"], "--num-prompts", "2", "--max-new-tokens", "6", "--out", out,
            "--no-baseline")
    assert r.code == 1
    rep = json.loads((out / "report.json").read_text())
    assert rep["lossless"] is False and rep["mismatches"][0]["index"] == 1 and rep["near_ties"] == []
    m = rep["mismatches"][0]
    assert m["logit_gap"] > m["tolerance"] > 0
    assert "NOT LOSSLESS" in r.text


def test_cli_without_target_recorded_is_a_config_error(served, cli, tmp_path):
    from dflash_model.drafter import DFlashDrafter, export_drafter
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(served["target"])
    drafter = DFlashDrafter(cfg, num_layers=1, block_size=B, target_layer_ids=[1], mask_token_id=151669)
    export = export_drafter(drafter, tmp_path / "e")
    r = cli("evaluate", export, "--prompts", served["heldout"])
    assert r.code == 2 and "no target recorded" in r.text


def test_stage_every_and_final(served, tmp_path, caplog):
    """The stage evaluates every N-th checkpoint and the final one, and logs each phase of an
    evaluation as it starts and ends (the baseline's at the first checkpoint)."""
    from dflash_core.stage import StageContext
    from dflash_stages.evaluate.stage import EvaluateConfig, SpecDecodeEvaluate

    cfg = EvaluateConfig(every=2, num_prompts=1, max_new_tokens=4, prompts=str(served["heldout"]))
    stage = SpecDecodeEvaluate(cfg)
    ctx = StageContext(stage="evaluate", config=cfg, device="cpu", work_dir=str(tmp_path))
    items = [{"kind": "checkpoint", "step": s, "export": str(served["export"]), "final": s == 30}
             for s in (10, 20, 30)]
    with caplog.at_level(logging.INFO):
        reports = list(stage.run({"checkpoints": iter(items)}, ctx))
    assert [r["step"] for r in reports] == [20, 30]  # 2nd checkpoint, then the final one
    phases = [re.sub(r"so far [0-9.]+", "so far T", r.getMessage()) for r in caplog.records
              if re.match(r"evaluate: step \d+: ", r.getMessage())]
    evaluation = lambda step: [f"evaluate: step {step}: {line}" for line in (
        "DFlash: 0/1 prompts", "DFlash: 1/1 prompts, τ so far T", "τ_sim: 0/1 prompts", "τ_sim: 1/1 prompts")]
    assert phases == [f"evaluate: step 10: {line}" for line in (
        "greedy reference: 0/1 prompts", "greedy reference: 1/1 prompts",
        "n-gram: 0/1 prompts", "n-gram: 1/1 prompts, τ so far T")] + evaluation(20) + evaluation(30)
    timing = reports[-1]["timing"]
    assert 0 < timing["tau_sim_features_s"] <= timing["tau_sim_s"]
    assert all(r["kind"] == "eval_report" and r["lossless"] for r in reports)
    assert (tmp_path / "step-0000020" / "report.json").exists()
    assert {"tau", "tau_ngram", "tau_sim", "tau_ref", "gap_flag", "lossless"} <= set(ctx.summary)
    assert SpecDecodeEvaluate.report(ctx.summary) is not None


@pytest.mark.parametrize("early", [True, False])
def test_stage_makes_the_baseline_once_at_the_first_checkpoint(served, tmp_path, monkeypatch, early):
    """The greedy reference and the n-gram run depend on no drafter: the stage decodes them once, at
    the first checkpoint even when it evaluates a later one (``early_baseline``: while training goes
    on), and each report equals an evaluation that decodes them itself."""
    from dflash_core.stage import StageContext
    from dflash_stages.evaluate import runs
    from dflash_stages.evaluate.export import evaluate_export
    from dflash_stages.evaluate.stage import EvaluateConfig, SpecDecodeEvaluate

    taken, decoded_at = [], []
    real = runs.reference_decode
    monkeypatch.setattr(runs, "reference_decode", lambda *a, **k: (decoded_at.append(len(taken)), real(*a, **k))[1])

    def checkpoints():
        for s in (10, 20, 30):
            taken.append(s)
            yield {"kind": "checkpoint", "step": s, "export": str(served["export"]), "final": s == 30}

    cfg = EvaluateConfig(every=2, num_prompts=2, max_new_tokens=6, prompts=str(served["heldout"]), early_baseline=early)
    ctx = StageContext(stage="evaluate", config=cfg, device="cpu", work_dir=str(tmp_path))
    reports = list(SpecDecodeEvaluate(cfg).run({"checkpoints": checkpoints()}, ctx))
    assert [r["step"] for r in reports] == [20, 30]
    assert decoded_at == ([1] if early else [2])  # once: during the first checkpoint, or the first evaluated
    assert [r["timing"]["baseline_reused"] for r in reports] == [True, True]
    assert [r["timing"]["baseline_step"] for r in reports] == ([10, 10] if early else [20, 20])

    alone = evaluate_export(str(served["export"]), prompts=str(served["heldout"]), num_prompts=2, max_new_tokens=6)
    assert len(decoded_at) == 2 and alone["timing"]["baseline_reused"] is False
    for r in reports:
        for key in ("tau", "tau_ngram", "ngram_split", "identical", "lossless", "near_ties", "tau_ref"):
            assert r[key] == alone[key], key
        rate = "tokens_per_s"  # a clock's reading, the rest counts
        counts = lambda report: {k: v for k, v in report["ngram"].items() if k != rate}
        assert counts(r) == counts(alone)
        assert [p["tau_ngram"] for p in r["per_prompt"]] == [p["tau_ngram"] for p in alone["per_prompt"]]


def test_a_baseline_made_for_other_settings_is_not_used(served):
    from dflash_model.target.load import load_target
    from dflash_stages.evaluate.export import evaluate_export, export_baseline

    kw = dict(prompts=str(served["heldout"]), num_prompts=2, loaded_target=load_target(str(served["target"])))
    base = export_baseline(str(served["export"]), max_new_tokens=6, **kw)
    longer = evaluate_export(str(served["export"]), max_new_tokens=7, prepared=base, **kw)
    assert longer["timing"]["baseline_reused"] is False and longer["generated_tokens"] == 14
    other = evaluate_export(str(served["export"]), max_new_tokens=6, prepared=base,
                            **{**kw, "loaded_target": load_target(str(served["target"]))})
    assert other["timing"]["baseline_reused"] is False  # another model object: maybe other weights
    same = evaluate_export(str(served["export"]), max_new_tokens=6, prepared=base, **kw)
    assert same["timing"]["baseline_reused"] is True and same["tau_ngram"] == base.ngram.summary(B)["tau"]


def test_cli_on_a_directory_that_is_not_an_export_says_what_one_holds(served, cli, tmp_path):
    for wrong in (tmp_path, served["target"]):  # an empty directory; a model directory (config.json, no drafter)
        r = cli("evaluate", wrong, "--device", "cpu")
        assert r.code == 2
        assert "is not an exported drafter" in r.text and "model.safetensors" in r.text
        assert "checkpoints/step-NNNNNNN/export" in r.text


def test_cli_on_cpu_takes_a_few_prompts_and_shows_each_phase_as_it_goes(served, cli):
    """Each decode says when it starts and after each batch (on a CPU each takes minutes), the
    drafters' with their τ so far."""
    out = served["root"] / "eval_cpu"
    r = cli("evaluate", served["export"], "--max-new-tokens", "6", "--device", "cpu", "--out", out,
            "--batch-size", "2")
    assert r.code == 0, r.text
    assert "the first 8 prompts" in r.text
    shown = [re.sub(r"so far [0-9.]+", "so far T", line) for line in r.text.splitlines()
             if re.match(r"(greedy reference|n-gram|DFlash|τ_sim): ", line)]
    assert shown == ["greedy reference: 0/3 prompts", "greedy reference: 2/3 prompts", "greedy reference: 3/3 prompts",
                     "n-gram: 0/3 prompts", "n-gram: 2/3 prompts, τ so far T", "n-gram: 3/3 prompts, τ so far T",
                     "DFlash: 0/3 prompts", "DFlash: 2/3 prompts, τ so far T", "DFlash: 3/3 prompts, τ so far T",
                     "τ_sim: 0/3 prompts", "τ_sim: 3/3 prompts"]
    assert json.loads((out / "report.json").read_text())["num_prompts"] == 3  # the file holds 3


def test_a_blocks_tau_does_not_depend_on_the_other_anchors_of_the_pass(target, prompts):
    """evaluate reads τ_sim at the served anchors out of one pass over every anchor: each block sees
    the context's features and itself only, so its τ is the same as in a pass over a few anchors."""
    from dflash_model.drafter import FeatureBatch, drafter_loss
    from dflash_model.target.capture import embeddings_and_head
    from dflash_model.target.spec_decode import teacher_forced_tau

    prompt = prompts[1]
    ref = greedy_decode(target, prompt, 16)
    drafter = _memorizing_drafter(target, [prompt], [ref[:10]])  # knows the first part of the text only
    embed, head = embeddings_and_head(target)
    every = teacher_forced_tau(drafter, target, prompt, ref, embed, head, [0, 1])
    T = len(prompt) + len(ref)
    assert sorted(every["anchor_tau"]) == list(range(len(prompt), T - B + 1))  # full blocks only
    assert every["n_blocks"] == len(every["anchor_tau"])
    assert every["tau_sim"] == pytest.approx(sum(every["anchor_tau"].values()) / every["n_blocks"])

    ids = torch.tensor(prompt + ref)
    mask = torch.zeros(T, dtype=torch.long)
    mask[len(prompt):] = 1
    feats = FeatureCapture(target, [0, 1]).capture(ids[None])[0][0]
    few = [len(prompt) + 1, len(prompt) + 4, len(prompt) + 8]
    out = drafter_loss(drafter, FeatureBatch(feats, ids, mask, torch.arange(T), [T]), torch.tensor(few), embed, head,
                       attn_backend="sdpa")
    assert out.block_tau.tolist() == [every["anchor_tau"][a] for a in few]
    assert len(set(every["anchor_tau"].values())) > 2  # right for long runs of some blocks, not of others


def test_tau_sim_builds_no_autograd_graph(target, prompts):
    """τ_sim is a measurement: the drafter's forward runs without autograd (a graph would keep every
    layer's activations of the pass alive until its results are read)."""
    from dflash_model.target.capture import embeddings_and_head
    from dflash_model.target.spec_decode import teacher_forced_tau

    prompt = prompts[1]
    ref = greedy_decode(target, prompt, 16)
    drafter = _memorizing_drafter(target, [prompt], [ref])
    grad_on = []
    hook = drafter.register_forward_hook(lambda m, args, out: grad_on.append((torch.is_grad_enabled(),
                                                                              out.requires_grad)))
    try:
        sim = teacher_forced_tau(drafter, target, prompt, ref, *embeddings_and_head(target), [0, 1])
    finally:
        hook.remove()
    assert grad_on == [(False, False)]
    assert sim["n_blocks"] > 0


def _memorizing_drafter(target, prompts, refs):
    """A DFlash drafter trained on these prompts' greedy completions until it drafts much of them."""
    from dflash_model.drafter import DFlashDrafter, FeatureBatch, anchor_candidates, drafter_loss
    from dflash_model.target.capture import embeddings_and_head

    torch.manual_seed(0)
    drafter = DFlashDrafter(target.config, num_layers=1, block_size=B, target_layer_ids=[0, 1], mask_token_id=126)
    embed, head = embeddings_and_head(target)
    rows = []
    for p, ref in zip(prompts, refs):
        ids = torch.tensor(p + ref)
        feats = FeatureCapture(target, [0, 1]).capture(ids[None])[0][0].detach()
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[len(p):] = 1
        rows.append((feats, ids, mask, anchor_candidates(mask, torch.zeros_like(mask))))
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(60):
        for feats, ids, mask, anchors in rows:
            batch = FeatureBatch(feats, ids, mask, torch.arange(len(ids)), [len(ids)])
            out = drafter_loss(drafter, batch, anchors, embed, head, attn_backend="sdpa")
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return drafter.eval()


def test_tau_sim_is_measured_on_the_served_output(target, prompts, monkeypatch):
    """τ_sim at the served anchors is the served τ, prompt by prompt, also where the output left the
    greedy reference (in bf16 it does at near ties): it is measured on what was served. Here the
    reference is altered at its third token, so every output leaves it there."""
    from dflash_stages.evaluate import runs as eval_runs
    from dflash_stages.evaluate.drafter import evaluate_drafter

    refs = [greedy_decode(target, p, 24) for p in prompts]
    drafter = _memorizing_drafter(target, prompts, refs)
    real = eval_runs.reference_decode

    def altered(*args, **kwargs):
        outs, seconds = real(*args, **kwargs)
        return [o[:2] + [(o[2] + 1) % 100] + o[3:] for o in outs], seconds

    monkeypatch.setattr(eval_runs, "reference_decode", altered)
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=24, baseline=False, batch_size=2,
                           tie_tolerance=0.0)
    assert not rep["lossless"] and {m["index"] for m in rep["mismatches"]} == {2}
    assert rep["tau"] > 2.0  # the drafter drafts much of what it was trained on
    for row in rep["per_prompt"]:
        assert row["tau_sim"] == pytest.approx(row["tau"], abs=1e-6)
        assert row["generated"] == 24
    assert rep["tau_sim"] == pytest.approx(rep["tau"], abs=1e-6) and not rep["gap_flag"]


def test_tau_serve_estimates_the_served_tau_where_tau_sim_all_does_not(target):
    """Half the prompts are ones the drafter learnt by heart, half are new: τ per anchor is high on
    the first and ~1 on the second. Served τ is tokens per cycle, so the plain mean over every
    anchor (tau_sim_all) overstates it; the harmonic mean (tau_serve_all) is close to it."""
    from dflash_stages.evaluate.drafter import evaluate_drafter

    rng = random.Random(1)
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (5, 9, 3, 7, 4, 6, 8, 5)]
    refs = [greedy_decode(target, p, 48) for p in prompts]
    drafter = _memorizing_drafter(target, prompts[:4], refs[:4])
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=48, baseline=False, batch_size=4)
    assert rep["tau_sim_all"] > 1.4 * rep["tau"]
    assert abs(rep["tau_serve_all"] - rep["tau"]) < 0.1 * rep["tau"]
    assert all(r["tau_serve_all"] <= r["tau_sim_all"] for r in rep["per_prompt"])


def test_cycles_on_a_fixed_text_follow_each_anchors_tau():
    """Each cycle starts where the last one's τ took the text. With block 16 and 40 tokens to produce
    after a 10-token prompt (end 50), a cycle at anchor a may draft min(15, 48 − a) tokens: whole up
    to anchor 33, its τ capped at 49 − a; the decode stops once it has produced the last token, or at
    an anchor with no measured τ (the text ended)."""
    from dflash_model.target.spec_decode import cycles_on_text

    tau = {10: 3.0, 11: 1.0, 12: 5.0, 13: 2.0, 14: 1.0, 15: 16.0, 31: 1.0, 32: 12.0, 44: 16.0}
    assert cycles_on_text(tau, 10, 50, 16) == [(3, True), (2, True), (16, True), (1, True), (12, True),
                                              (5, False)]  # at 44: 4 drafts of budget, τ 16 capped at 5
    # to produce 24 tokens: at 31 one draft of budget, at 32 none; the decode stops at 33
    assert cycles_on_text(tau, 10, 34, 16) == [(3, True), (2, True), (16, True), (1, False), (1, False)]
    assert cycles_on_text(tau, 11, 50, 16) == [(1, True), (5, True)]  # 11 -> 12 -> 17: no τ measured there
    assert cycles_on_text({}, 10, 50, 16) == []


def test_tau_ref_is_the_served_tau_where_the_output_is_the_reference(target, prompts):
    """In float32 the served decode is the greedy reference, token for token, so the cycles a decode
    of the reference makes are the served cycles: τ on the reference equals served τ, per prompt and
    pooled."""
    from dflash_stages.evaluate.drafter import evaluate_drafter

    refs = [greedy_decode(target, p, 40) for p in prompts]
    drafter = _memorizing_drafter(target, prompts, refs)
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=40, baseline=False, batch_size=2)
    assert rep["lossless"] and rep["identical"] == len(prompts)
    assert rep["tau"] > 2.0
    for row in rep["per_prompt"]:
        assert row["tau_ref"] == pytest.approx(row["tau"], abs=1e-9)
    assert rep["tau_ref"] == pytest.approx(rep["tau"], abs=1e-9)


@pytest.mark.parametrize("row_tokens", [1, 20, 10_000])
def test_packed_features_are_each_texts_own(target, prompts, row_tokens):
    """evaluate's τ_sim takes its texts' features from forwards over several texts at once (one a
    row, a few, or all): each text's are those of a forward of it alone."""
    from dflash_model.target.spec_decode import packed_features

    texts = [p + greedy_decode(target, p, 6) for p in prompts] + [prompts[0]]
    got = list(packed_features(target, texts, [0, 1], row_tokens=row_tokens))
    assert [i for i, _ in got] == list(range(len(texts)))
    for (_, feats), text in zip(got, texts):
        alone = FeatureCapture(target, [0, 1]).capture(torch.tensor(text)[None])[0][0]
        assert feats.shape == alone.shape and torch.allclose(feats, alone, atol=1e-5, rtol=1e-5)


def test_evaluate_reports_the_same_with_its_texts_packed_as_on_a_gpu(target, prompts, monkeypatch):
    """On CUDA evaluate packs its texts into rows for τ_sim and τ_ref (here forced on the CPU): the
    report's figures are those of one text a forward, prompt by prompt."""
    import functools

    from dflash_model.target import spec_decode
    from dflash_stages.evaluate import runs as eval_runs
    from dflash_stages.evaluate.drafter import evaluate_drafter

    refs = [greedy_decode(target, p, 24) for p in prompts]
    drafter = _memorizing_drafter(target, prompts, [r[:12] for r in refs])
    real = eval_runs.reference_decode

    def altered(*args, **kwargs):  # a reference the served text leaves at its third token: two texts a prompt
        outs, seconds = real(*args, **kwargs)
        return [o[:2] + [(o[2] + 1) % 100] + o[3:] for o in outs], seconds

    monkeypatch.setattr(eval_runs, "reference_decode", altered)
    keys = ("tau_sim", "tau_sim_all", "tau_ref", "sim_loss")
    alone = evaluate_drafter(target, drafter, prompts, max_new_tokens=24, baseline=False, batch_size=2,
                             tie_tolerance=0.0)
    monkeypatch.setattr(spec_decode, "packed_features",
                        functools.partial(spec_decode.packed_features, row_tokens=10_000))
    packed = evaluate_drafter(target, drafter, prompts, max_new_tokens=24, baseline=False, batch_size=2,
                              tie_tolerance=0.0)
    for a, b in zip(alone["per_prompt"], packed["per_prompt"]):
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], abs=1e-5, nan_ok=True)
    assert [packed[k] for k in keys] == pytest.approx([alone[k] for k in keys], abs=1e-5, nan_ok=True)
    assert alone["tau_ref"] != pytest.approx(alone["tau_sim"], abs=1e-3)  # the reference was a text of its own


def test_tau_ref_is_measured_on_the_reference_not_on_the_served_output(target, prompts, monkeypatch):
    """Where the served output leaves the reference (here the reference is altered at its third
    token), τ_sim follows the served text and τ_ref the reference: the walk over the reference's own
    teacher-forced τ, whatever was served."""
    from dflash_model.target.capture import embeddings_and_head
    from dflash_model.target.spec_decode import cycles_on_text, teacher_forced_tau
    from dflash_stages.evaluate import runs as eval_runs
    from dflash_stages.evaluate.drafter import evaluate_drafter

    refs = [greedy_decode(target, p, 24) for p in prompts]
    drafter = _memorizing_drafter(target, prompts, refs)
    real = eval_runs.reference_decode
    altered_refs: list[list[int]] = []

    def altered(*args, **kwargs):
        outs, seconds = real(*args, **kwargs)
        altered_refs.extend(o[:2] + [(o[2] + 1) % 100] + o[3:] for o in outs)
        return list(altered_refs), seconds

    monkeypatch.setattr(eval_runs, "reference_decode", altered)
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=24, baseline=False, batch_size=2,
                           tie_tolerance=0.0)
    embed, head = embeddings_and_head(target)
    for row, prompt, ref in zip(rep["per_prompt"], prompts, altered_refs):
        sim = teacher_forced_tau(drafter, target, prompt, ref, embed, head, list(drafter.config.target_layer_ids))
        taus = [t for t, whole in cycles_on_text(sim["anchor_tau"], len(prompt), len(prompt) + 24, B) if whole]
        assert row["tau_ref"] == pytest.approx(sum(taus) / len(taus))
        assert row["tau_sim"] == pytest.approx(row["tau"], abs=1e-6)
    assert any(abs(row["tau_ref"] - row["tau"]) > 0.1 for row in rep["per_prompt"])


@pytest.mark.parametrize("max_new_tokens", [2, 3, 4])
def test_tau_ref_counts_cycles_as_served_when_no_cycle_has_a_whole_block(target, prompts, max_new_tokens):
    """With fewer tokens to produce than a block needs, served τ counts every cycle, each capped by
    its budget; τ on the reference (here the served output) counts the same cycles."""
    from dflash_stages.evaluate.drafter import evaluate_drafter

    refs = [greedy_decode(target, p, 40) for p in prompts]
    drafter = _memorizing_drafter(target, prompts, refs)
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=max_new_tokens, baseline=False, batch_size=2)
    assert rep["full_cycles"] == 0 and rep["identical"] == len(prompts)
    for row in rep["per_prompt"]:
        assert row["tau_ref"] == pytest.approx(row["tau"])
    assert rep["tau_ref"] == pytest.approx(rep["tau"])


def test_evaluations_naming_one_reference_directory_share_one_greedy_text(served, cli, monkeypatch):
    """``--reference DIR``: the first evaluation decodes the greedy reference and writes it there; a
    later one of the same target, prompts and length reads it and decodes none (τ_ref on the same
    text); another length, or the target's files written again, gets a reference of its own; a file
    that cannot be read is exit 2 with its path."""
    from dflash_stages.evaluate import runs as eval_runs

    refs = served["root"] / "refs"

    def evaluate(out: str, tokens: str = "6"):
        return cli("evaluate", served["export"], "--num-prompts", "2", "--max-new-tokens", tokens, "--device", "cpu",
                   "--reference", refs, "--out", served["root"] / out)

    first = evaluate("eval_ref1")
    assert first.code == 0, first.text
    (written,) = refs.glob("*.json")
    doc = json.loads(written.read_text())
    assert len(doc["outputs"]) == 2 and doc["target"] == str(served["target"])
    rep1 = json.loads((served["root"] / "eval_ref1" / "report.json").read_text())
    assert rep1["timing"]["greedy_s"] is not None and rep1["reference_dir"] == str(refs)
    timing = rep1["timing"]
    assert 0 < timing["spec_draft_s"] + timing["spec_verify_s"] <= timing["spec_s"]

    real = eval_runs.reference_decode
    decoded: list[int] = []

    def counted(*a, **k):
        decoded.append(1)
        return real(*a, **k)

    monkeypatch.setattr(eval_runs, "reference_decode", counted)
    second = evaluate("eval_ref2")
    assert second.code == 0, second.text
    assert not decoded
    rep2 = json.loads((served["root"] / "eval_ref2" / "report.json").read_text())
    assert rep2["timing"]["greedy_s"] is None and rep2["lossless"] is True
    assert [r["tau_ref"] for r in rep2["per_prompt"]] == [r["tau_ref"] for r in rep1["per_prompt"]]

    assert evaluate("eval_ref3", tokens="5").code == 0 and len(decoded) == 1  # another length: its own
    config = served["target"] / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))  # written again
    assert evaluate("eval_ref4").code == 0 and len(decoded) == 2 and len(list(refs.glob("*.json"))) == 3

    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns - 10**9))  # as it was
    written.write_text("{not json")
    broken = evaluate("eval_ref5")
    assert broken.code == 2 and str(written) in broken.text and "remove it" in broken.text


def test_a_shared_reference_is_decoded_once_by_concurrent_evaluations(tmp_path):
    """Evaluations started together on one file: one decodes while the others wait on the file's
    lock, then all return its outputs."""
    import threading

    from dflash_stages.evaluate.reference import reference_key, shared_reference

    calls: list[int] = []
    started = threading.Barrier(4)

    def decode() -> tuple[list[list[int]], float]:
        calls.append(1)
        return [[len(calls), 7, 9]], 0.5

    key = reference_key("tiny", "float32", [[1, 2, 3]], 3)
    got: list[tuple[list[list[int]], float | None]] = []

    def evaluation() -> None:
        started.wait()
        got.append(shared_reference(tmp_path, key, "tiny", decode))

    threads = [threading.Thread(target=evaluation) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and [outputs for outputs, _ in got] == [[[1, 7, 9]]] * 4
    assert sorted(s is None for _, s in got) == [False, True, True, True]  # one decoded, three read
    assert key != reference_key("tiny", "bfloat16", [[1, 2, 3]], 3) != reference_key("tiny", "float32", [[1, 2]], 3)
