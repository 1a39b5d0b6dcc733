"""evaluate's split of cycles by whether the n-gram drafter has a match where they start
(``runs.ngram_split``): the class of a crafted text's positions, the per-class figures of crafted
cycles, the classes against what the n-gram drafter really drafted, and an evaluate whose split adds
up to its totals, batched and one prompt at a time."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_model.target.spec_batch import one_by_one, speculative_decode_batch
from dflash_model.target.spec_decode import DecodeResult, greedy_decode, ngram_drafter, speculative_decode
from dflash_stages.evaluate.runs import DecodeRun, cycle_match_lengths, ngram_split
from tests.stages.test_evaluate import _memorizing_drafter, tiny_qwen3

B = 4

# positions 0..10; the n-gram drafter's match at each, as the longest earlier suffix:
#   5 6 7 | 5: "5" | 5 6: "5 6" | 8 9: none | 5: "5" | 5 6: "5 6" | 5 6 7: "5 6 7" | 1: none
TEXT = [5, 6, 7, 5, 6, 8, 9, 5, 6, 7, 1]
MATCH_LENGTHS = [0, 0, 0, 1, 2, 0, 0, 1, 2, 3, 0]


def _cycles(anchors: list[int], accepted: list[int]) -> DecodeResult:
    """A decode of TEXT after the one-token prompt TEXT[:1], with these cycles."""
    return DecodeResult(tokens=TEXT[1:], drafted=[B - 1] * len(anchors), accepted=accepted,
                        budget=[B - 1] * len(anchors), anchors=anchors, block_size=B)


def test_match_length_at_every_position_of_a_crafted_text():
    every = _cycles(list(range(1, len(TEXT))), [0] * (len(TEXT) - 1))
    assert cycle_match_lengths(TEXT[:1], every) == MATCH_LENGTHS[1:]
    # a cycle's class is read at its own start, whatever came before it
    assert cycle_match_lengths(TEXT[:1], _cycles([9, 4, 10], [0, 0, 0])) == [3, 2, 0]


def test_split_of_crafted_cycles():
    # starts at 1, 2, 4, 6, 9 (each the previous + τ); classes 0, 0, 2, 0, 3
    dflash = _cycles([1, 2, 4, 6, 9], [0, 1, 1, 2, 0])
    # starts at 1, 2, 3, 5, 6, 7, 9; classes 0, 0, 1, 0, 0, 1, 3
    ngram = _cycles([1, 2, 3, 5, 6, 7, 9], [0, 0, 1, 0, 0, 1, 0])
    split = ngram_split([TEXT[:1]], {"dflash": DecodeRun([dflash], 1.0), "ngram": DecodeRun([ngram], 1.0)})
    assert split["match"] == {"dflash": {"cycles": 2, "tokens": 3, "tau": 1.5, "share": 3 / 9},
                              "ngram": {"cycles": 3, "tokens": 5, "tau": 5 / 3, "share": 5 / 9}}
    assert split["no_match"] == {"dflash": {"cycles": 3, "tokens": 6, "tau": 2.0, "share": 6 / 9},
                                 "ngram": {"cycles": 4, "tokens": 4, "tau": 1.0, "share": 4 / 9}}
    by_n = split["match_length"]
    assert list(by_n) == ["3", "2", "1"]
    assert by_n["3"]["dflash"] == {"cycles": 1, "tokens": 1, "tau": 1.0, "share": 1 / 9}
    assert by_n["2"]["dflash"] == {"cycles": 1, "tokens": 2, "tau": 2.0, "share": 2 / 9}
    assert by_n["1"]["dflash"] == {"cycles": 0, "tokens": 0, "tau": None, "share": 0.0}
    assert by_n["1"]["ngram"] == {"cycles": 2, "tokens": 4, "tau": 2.0, "share": 4 / 9}
    without = ngram_split([TEXT[:1]], {"dflash": DecodeRun([dflash], 1.0), "ngram": None})
    assert without["no_match"]["ngram"] is None and without["no_match"]["dflash"] == split["no_match"]["dflash"]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_qwen3()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(100) for _ in range(n)] for n in (5, 9, 3, 7)]


def test_classes_are_where_the_ngram_drafter_drafts(target, prompts):
    """In the n-gram drafter's own decodes, per-prompt and batched, a cycle with draft budget is in
    the match class exactly when the drafter proposed something."""
    batch = speculative_decode_batch(target, prompts, one_by_one(ngram_drafter()), B, 32)
    for prompt, batched in zip(prompts, batch):
        single = speculative_decode(target, prompt, ngram_drafter(), B, 32)
        for res in (single, batched):
            lengths = cycle_match_lengths(prompt, res)
            with_budget = [(n, d) for n, d, b in zip(lengths, res.drafted, res.budget) if b > 0]
            assert [n > 0 for n, _ in with_budget] == [d > 0 for _, d in with_budget]
        assert cycle_match_lengths(prompt, single) == cycle_match_lengths(prompt, batched)
    every = [n for p, r in zip(prompts, batch) for n in cycle_match_lengths(p, r)]
    assert 0 in every and max(every) == 3  # new text and 3-token copies both occur


def assert_split_adds_up(rep: dict) -> None:
    """The split's classes partition each drafter's cycles: cycles add up to the cycles, tokens to
    the generated tokens (one per output comes from the prefill, in no cycle), and the two classes'
    τ recombine to ``tau_all``; the suffix lengths partition the match class."""
    split = rep["ngram_split"]
    totals = {"dflash": rep, "ngram": rep["ngram"]}
    for name, total in totals.items():
        if total is None:
            assert split["match"][name] is None and split["no_match"][name] is None
            continue
        match, new = split["match"][name], split["no_match"][name]
        assert match["cycles"] + new["cycles"] == total["cycles"]
        assert match["tokens"] + new["tokens"] + rep["num_prompts"] == total["generated_tokens"]
        for part in (match, new):
            assert part["tau"] == (part["tokens"] / part["cycles"] if part["cycles"] else None)
        assert (match["tokens"] + new["tokens"]) / total["cycles"] == pytest.approx(total["tau_all"])
        assert match["share"] + new["share"] == pytest.approx(1.0)
        by_n = [split["match_length"][n][name] for n in ("3", "2", "1")]
        assert sum(p["cycles"] for p in by_n) == match["cycles"]
        assert sum(p["tokens"] for p in by_n) == match["tokens"]


@pytest.mark.parametrize("batched", [True, False])
def test_evaluate_reports_the_split(target, prompts, batched, monkeypatch):
    """evaluate's split, from the batched loop and from the one-prompt loop (the hybrid targets' path):
    it partitions both drafters' cycles, n-gram gains nothing on new text, and the table shows it,
    with the served τ's difference from n-gram's and its standard error."""
    from rich.console import Console

    from dflash_model.target import spec_batch
    from dflash_stages.evaluate.drafter import evaluate_drafter
    from dflash_stages.evaluate.report import render_table

    refs = [greedy_decode(target, p, 32) for p in prompts]
    drafter = _memorizing_drafter(target, prompts[:2], refs[:2])
    if not batched:
        monkeypatch.setattr(spec_batch, "supports_batch", lambda model: False)
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=32, with_tau_sim=False, batch_size=2)
    assert rep["lossless"] and rep["generated_tokens"] == 4 * 32
    assert_split_adds_up(rep)
    split = rep["ngram_split"]
    assert split["no_match"]["ngram"]["tau"] == 1.0 < split["match"]["ngram"]["tau"]
    assert min(split[c][d]["cycles"] for c in ("match", "no_match") for d in ("dflash", "ngram")) > 0
    assert split["match"]["dflash"]["tau"] > 1.0 and split["no_match"]["dflash"]["tau"] > 1.0
    vs = rep["vs_ngram"]  # the served figures' difference, with its spread over the 4 prompts
    assert vs["diff"] == pytest.approx(rep["tau"] - rep["tau_ngram"]) and vs["se"] > 0 and vs["n"] == 4
    own = [(r["tau"], r["tau_ngram"]) for r in rep["per_prompt"]]
    assert (vs["wins"], vs["losses"]) == (sum(a > b for a, b in own), sum(a < b for a, b in own))

    console = Console(width=200, record=True)
    console.print(render_table(rep))
    text = console.export_text()
    assert f"{vs['diff']:+.2f} ± {vs['se']:.2f} ({vs['wins']} / {vs['losses']})" in text
    line = next(x for x in text.splitlines() if "no n-gram match" in x)
    new = split["no_match"]
    assert [c.strip() for c in line.split("│")[2:-1]] == [str(new["dflash"]["cycles"]), f"{new['dflash']['tau']:.2f}",
                                 f"{new['dflash']['share'] * 100:.0f}%", str(new["ngram"]["cycles"]), "1.00",
                                 f"{new['ngram']['share'] * 100:.0f}%"]
