"""evaluate's served τ against n-gram's, with the standard error of the difference over prompts
(``runs.pooled_difference``): crafted runs worked by hand, the fallback to all cycles, the warning
when the lead is within two standard errors, and the figure in a real evaluate's report."""

from __future__ import annotations

import math

import pytest

from dflash_model.target.spec_decode import DecodeResult
from dflash_stages.evaluate.drafter import add_warnings
from dflash_stages.evaluate.runs import DecodeRun, pooled_difference

B = 4  # a whole block of draft budget is 3


def _run(*prompts: tuple[list[int], list[int]]) -> DecodeRun:
    """A run whose prompt k made the cycles (accepted drafts, draft budget) of ``prompts[k]``."""
    results = [DecodeResult(tokens=[0] * (sum(acc) + len(acc)), drafted=list(budget), accepted=list(acc),
                            budget=list(budget), anchors=[0] * len(acc), block_size=B) for acc, budget in prompts]
    return DecodeRun(results, 1.0)


# counted (τ summed, cycles) per prompt: DFlash (8, 2), (3, 2), (3, 1): 14 / 5 = 2.8;
# n-gram (7, 4), (3, 3), (4, 1): 14 / 8 = 1.75 (prompt 2's second DFlash cycle had a budget of 1)
DFLASH = _run(([3, 3], [3, 3]), ([0, 1], [3, 3]), ([2, 0], [3, 1]))
NGRAM = _run(([1, 1, 1, 0], [3, 3, 3, 3]), ([0, 0, 0], [3, 3, 3]), ([3], [3]))


def test_the_difference_is_the_reports_and_its_standard_error_is_worked_by_hand():
    got = pooled_difference(DFLASH, NGRAM)
    assert got["diff"] == pytest.approx(DFLASH.summary(B)["tau"] - NGRAM.summary(B)["tau"]) == pytest.approx(1.05)
    # each prompt's counted tokens less τ × its cycles, over the mean cycles a prompt (5/3 and 8/3):
    # prompt 0: 2.4 × 0.6 − 0 = 1.44; prompt 1: −2.6 × 0.6 + 2.25 × 0.375 = −0.71625;
    # prompt 2: 0.2 × 0.6 − 2.25 × 0.375 = −0.72375; se = sqrt(Σ z² / (3 × 2))
    assert got["se"] == pytest.approx(math.sqrt((1.44 ** 2 + 0.71625 ** 2 + 0.72375 ** 2) / 6))
    assert (got["n"], got["wins"], got["losses"]) == (3, 2, 1)  # own τ 4 > 1.75, 1.5 > 1, 3 < 4


def test_prompts_alike_leave_no_doubt_and_unlike_ones_do():
    same = pooled_difference(_run(*[([3, 1], [3, 3])] * 4), _run(*[([1, 0, 0], [3, 3, 3])] * 4))
    assert same["diff"] == pytest.approx(3.0 - 4 / 3) and same["se"] == pytest.approx(0.0)
    assert (same["wins"], same["losses"]) == (4, 0)
    # the same pooled figures, made by prompts that differ: the lead is less sure
    mixed = pooled_difference(_run(([3, 3], [3, 3]), ([1, 1], [3, 3]), ([3, 3], [3, 3]), ([1, 1], [3, 3])),
                              _run(*[([1, 0, 0], [3, 3, 3])] * 4))
    assert mixed["diff"] == pytest.approx(same["diff"]) and mixed["se"] > 0.2


def test_a_prompt_without_a_whole_block_counts_nothing_where_others_have_one():
    """The run's pooled τ leaves out every cut-short cycle once any prompt has a whole block (not
    prompt by prompt): prompt 1 below adds no counted cycle, and its own τ (all its cycles) still
    makes it a win."""
    a = _run(([3, 1], [3, 3]), ([1, 1], [2, 1]))
    b = _run(([0, 0], [3, 3]), ([0, 0], [2, 1]))
    got = pooled_difference(a, b)
    assert got["diff"] == pytest.approx(a.summary(B)["tau"] - b.summary(B)["tau"]) == pytest.approx(3.0 - 1.0)
    assert (got["n"], got["wins"], got["losses"]) == (2, 2, 0)
    # counted (τ summed, cycles): (6, 2) and (0, 0) against (2, 2) and (0, 0): z = 0 on both prompts
    assert got["se"] == pytest.approx(0.0)


def test_without_a_whole_block_anywhere_every_cycle_counts():
    short_a, short_b = _run(([1, 0], [2, 2]), ([2], [2])), _run(([0, 0, 0], [2, 2, 2]), ([1, 1], [2, 2]))
    got = pooled_difference(short_a, short_b)
    assert got["diff"] == pytest.approx(short_a.summary(B)["tau"] - short_b.summary(B)["tau"])
    assert got["diff"] == pytest.approx(6 / 3 - 7 / 5)
    assert pooled_difference(_run(([3], [3])), _run(([0], [3]))) is None  # one prompt: no spread to read
    assert pooled_difference(_run(([], []), ([], [])), NGRAM) is None  # no cycles


@pytest.mark.parametrize("diff, se, warned", [(0.5, 0.2, False), (0.3, 0.2, True), (-0.1, 0.2, True)])
def test_a_lead_within_two_standard_errors_is_a_warning(diff, se, warned):
    rep = {"tau": 2.4, "lossless": True, "vs_ngram": {"diff": diff, "se": se, "n": 64, "wins": 34, "losses": 30}}
    add_warnings(rep)
    line = (f"DFlash does not clearly beat n-gram on these 64 prompts: served tau {diff:+.2f} ± {se:.2f} against "
            "n-gram's (the difference ± its standard error over prompts; 34 prompts won, 30 lost), so another "
            "sample of prompts may rank the two otherwise")
    assert rep["warnings"] == ([line] if warned else [])
