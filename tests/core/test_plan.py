"""``dflash-pipe plan``: the layout model (dflash_stages/layout/planner.py) with exact numbers, and the command
with given rates (no measurement). The measuring path is tests/stages/test_plan.py."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dflash_stages.layout.planner import PlanInputs, fan_in_splits, plan
from tests.conftest import REPO, STAGES

RT, RD = 7200.0, 23000.0
COLOCATED_4 = 4 / (1 / RT + 1 / RD)  # 21,933.77…


def test_memory_counts_the_allreduce_copy_and_the_received_queue_where_they_live():
    """The H200 run at Qwen3-32B dims (docs/benchmarks.md, session 8): one-GPU peaks 62.5 GiB
    (target) and 28.7 GiB (drafter, 2.57 B parameters), 8 queued rows of 400 MiB; measured on two
    GPUs: colocated 104.3-104.4 GiB each, fan-in 1→1 65.2-66.4 / 32.2 GiB, pairs 65.9 / 28.7."""
    row = 8192 * 5 * 5120 * 2
    inp = PlanInputs(9360.0, 29970.0, target_gib=62.5, drafter_gib=28.7, row_tokens=8192, row_bytes=row,
                     queued_rows=8, allreduce_gib=4 * 2_570_000_000 / 2**30)
    queue, allreduce = 8 * row / 2**30, 4 * 2_570_000_000 / 2**30
    two = plan(inp, 2)
    assert two.single.memory == (("target + drafter", pytest.approx(62.5 + 28.7 + queue)),)  # one replica
    assert two.colocated.memory == (("target + drafter", pytest.approx(62.5 + 28.7 + queue + allreduce)),)
    assert two.colocated.gib_per_gpu == pytest.approx(104.3, abs=0.5)  # 103.9 predicted
    assert two.fan_in.memory == (("target", pytest.approx(62.5 + queue)), ("drafter", pytest.approx(28.7 + queue)))
    assert two.pairs.memory == (("target", pytest.approx(62.5 + queue)), ("drafter", 28.7))
    four = plan(inp, 4)  # two replicas: each drafter GPU also holds the all-reduce's copy
    assert four.pairs.memory[1] == ("drafter", pytest.approx(28.7 + allreduce))
    assert dict(four.fan_in_splits[1].memory)["drafter"] == pytest.approx(28.7 + queue + allreduce)
    assert four.fan_in_splits[1].name == "fan-in 2→2"
    assert dict(four.fan_in.memory)["drafter"] == pytest.approx(28.7 + queue)  # 3→1: one replica
    unknown = plan(PlanInputs(9360.0, 29970.0, target_gib=62.5, drafter_gib=28.7), 2)
    assert unknown.colocated.gib_per_gpu == pytest.approx(62.5 + 28.7)
    assert any("not in the memory either" in n for n in unknown.notes)


def test_model_on_four_gpus_recommends_colocated():
    p = plan(PlanInputs(RT, RD, target_gib=60.0, drafter_gib=20.0), 4)
    assert p.pairs.tokens_per_s == 14400.0
    assert (p.pairs.target_gpus, p.pairs.drafter_gpus, p.pairs.bound) == (2, 2, "target")
    assert p.fan_in.name == "fan-in 3→1" and p.fan_in.tokens_per_s == 21600.0
    assert p.fan_in.bound == "target"
    assert [(x.name, x.tokens_per_s) for x in p.fan_in_splits] == [("fan-in 3→1", 21600.0),
                                                                  ("fan-in 2→2", 14400.0)]
    assert p.colocated.tokens_per_s == pytest.approx(COLOCATED_4, rel=1e-6)
    assert p.colocated.tokens_per_s == pytest.approx(21933.774834, rel=1e-6)
    assert p.single.tokens_per_s == pytest.approx(COLOCATED_4 / 4, rel=1e-6)
    assert p.recommended is p.colocated
    # memory per GPU as given; nothing to check it against
    assert p.pairs.memory == (("target", 60.0), ("drafter", 20.0))
    assert p.fan_in.memory == (("target", 60.0), ("drafter", 20.0))
    assert p.colocated.memory == (("target + drafter", 80.0),)
    assert p.colocated.gib_per_gpu == 80.0
    assert {x.fits for x in p.candidates()} == {None}
    # no row size: nothing about the link
    assert p.pairs.transfer_ms is None and p.pairs.link_busy is None


def test_colocated_that_does_not_fit_leaves_fan_in():
    p = plan(PlanInputs(RT, RD, target_gib=60.0, drafter_gib=20.0, gpu_gib=75.0), 4)
    assert p.colocated.fits is False and p.single.fits is False
    assert p.pairs.fits is True and p.fan_in.fits is True
    assert p.recommended is p.fan_in and p.recommended.tokens_per_s == 21600.0
    assert p.fan_in.how == ('torchrun --nproc_per_node 4; pack and extract with ranks: "0-2", train and '
                            "checkpoint with ranks: [3]; every device cuda:{local_rank}")
    # nothing fits
    p = plan(PlanInputs(RT, RD, target_gib=60.0, drafter_gib=20.0, gpu_gib=50.0), 4)
    assert p.recommended is None


def test_invalid_fan_in_splits_are_excluded():
    assert fan_in_splits(4) == ([(3, 1), (2, 2)], [])
    assert fan_in_splits(5) == ([(4, 1)], [(3, 2)])
    assert fan_in_splits(8) == ([(7, 1), (6, 2), (4, 4)], [(5, 3)])
    assert fan_in_splits(7) == ([(6, 1)], [(5, 2), (4, 3)])
    p = plan(PlanInputs(RT, RD), 8)
    assert [x.name for x in p.fan_in_splits] == ["fan-in 6→2", "fan-in 4→4", "fan-in 7→1"]
    assert [x.tokens_per_s for x in p.fan_in_splits] == [43200.0, 28800.0, 23000.0]
    assert p.fan_in_excluded == ((5, 3),)
    p = plan(PlanInputs(RT, RD), 5)  # odd G: 2 pairs and one idle GPU; fan-in 4→1 only
    assert (p.pairs.gpus, p.pairs.tokens_per_s) == (4, 14400.0)
    assert [x.name for x in p.fan_in_splits] == ["fan-in 4→1"] and p.fan_in.tokens_per_s == 23000.0
    p = plan(PlanInputs(RT, RD), 1)
    assert p.pairs is None and p.fan_in is None and p.fan_in_splits == ()
    assert p.recommended is p.colocated and p.colocated.tokens_per_s == p.single.tokens_per_s


def test_overlap_link_and_queued_rows():
    p = plan(PlanInputs(RT, RD, overlap=1.07), 4)
    assert p.colocated.tokens_per_s == pytest.approx(1.07 * COLOCATED_4, rel=1e-9)
    # a row of 1 GB at 100 GB/s: 10 ms, hidden (pairs: 2 rows/s per drafter GPU... far below 100)
    p = plan(PlanInputs(RT, RD, row_tokens=8192, row_bytes=10**9), 4)
    assert p.pairs.transfer_ms == pytest.approx(10.0)
    assert p.pairs.link_busy == pytest.approx(0.01 * 7200 / 8192)
    assert p.fan_in.link_busy == pytest.approx(0.01 * 21600 / 8192)
    assert p.pairs.transfer_hidden and p.pairs.tokens_per_s == 14400.0
    assert p.colocated.transfer_ms is None
    # at 0.5 GB/s a row takes 2 s: the link, not the stages, bounds pairs and fan-in
    p = plan(PlanInputs(RT, RD, row_tokens=8192, row_bytes=10**9, link_gbps=0.5), 4)
    assert p.pairs.link_busy == pytest.approx(2.0 * 7200 / 8192) and not p.pairs.transfer_hidden
    assert (p.pairs.bound, p.pairs.tokens_per_s) == ("link", 2 * 8192 / 2.0)
    assert (p.fan_in.name, p.fan_in.bound, p.fan_in.tokens_per_s) == ("fan-in 2→2", "link", 8192.0)
    assert p.colocated.tokens_per_s == pytest.approx(COLOCATED_4)
    assert any("link-bound" in n for n in p.notes)
    # rows queued on the extract GPU count there (target GPUs, colocated GPUs), not on drafters
    p = plan(PlanInputs(RT, RD, target_gib=60.0, drafter_gib=20.0, row_tokens=8192, row_bytes=2**30 // 8,
                        queued_rows=8), 4)
    assert p.pairs.memory == (("target", 61.0), ("drafter", 20.0))
    assert p.colocated.memory == (("target + drafter", 81.0),)


def test_bad_inputs_are_refused():
    for kw in (dict(target_tok_s=0.0, drafter_tok_s=1.0), dict(target_tok_s=1.0, drafter_tok_s=1.0, overlap=0.0),
               dict(target_tok_s=1.0, drafter_tok_s=1.0, target_gib=-1.0)):
        with pytest.raises(ValueError):
            PlanInputs(**kw)
    with pytest.raises(ValueError):
        plan(PlanInputs(1.0, 1.0), 0)


# ------------------------------------------------------------------------- the command
PIPELINE = """
    stages:
      pack: {uses: "pack:random", params: {rows: 4, tokens_per_row: 8192}}
      extract: {uses: hf_hooks, after: pack, params: {model: "random:qwen3-32b", layers: [1, 16, 31, 46, 61]}}
      train: {uses: dflash, after: extract, params: {num_layers: 5}}
"""


def test_cli_with_given_rates_prints_every_layout_and_the_recommendation(cli, write_pipeline):
    path = write_pipeline(PIPELINE)
    res = cli("plan", path, "--rates", "7200,23000", "--memory", "60,20", "--gpus", "4")
    assert res.code == 0, res.text
    assert "plan for" in res.out and "on 4 GPUs (--gpus)" in res.out
    assert res.lines_with("one GPU alone (reference)", "5,483", "1.00×", "83.1")
    assert res.lines_with("│ pairs ", "2 targets → 2 drafters", "14,400", "target 63.1 / drafter 20.0")
    assert res.lines_with("│ fan-in 3→1 ", "3 targets → 1 drafter", "21,600")
    assert res.lines_with("│ colocated", "← recommended", "21,934", "4.00×", "83.1", "none (same GPU)")
    assert "fan-in splits (tokens/s, best first): 3→1 21,600, 2→2 14,400 (= pairs)" in res.out
    assert "recommended: colocated — 21,934 tokens/s on 4 GPUs" in res.out
    # the feature row of 8,192 tokens x 5 layers x 5120 x bf16, and its copy at 100 GB/s
    assert "8,192 tokens × 5 × 5120 × 2 B = 400.0 MiB; copy 4.2 ms at 100 GB/s" in res.out
    assert "all-reduce" in res.out and "no 4-GPU run yet" in res.out

    # colocated (83.1 GiB) does not fit in 80: fan-in is recommended
    res = cli("plan", path, "--rates", "7200,23000", "--memory", "60,20", "--gpus", "4", "--gpu-memory", "80")
    assert res.code == 0, res.text
    assert res.lines_with("│ colocated", "NO (> 80.0)")
    assert res.lines_with("│ fan-in 3→1", "← recommended", "yes")
    assert "recommended: fan-in 3→1 — 21,600 tokens/s on 4 GPUs" in res.out

    res = cli("plan", path, "--rates", "7200,23000", "--gpus", "4", "--json")
    assert res.code == 0, res.text
    import json

    out = json.loads(res.out)
    assert out["plan"]["pairs"]["tokens_per_s"] == 14400.0 and out["measured"] is None
    assert out["plan"]["recommended"]["name"] == "colocated" and out["job"] is None


def test_cli_prints_the_jobs_time_on_the_recommended_layout(cli, write_pipeline):
    """10.8e9 tokens at the recommended colocated 21,934 tokens/s: 492,387 s = 136.8 h."""
    path = write_pipeline(PIPELINE)
    res = cli("plan", path, "--rates", "7200,23000", "--memory", "60,20", "--gpus", "4", "--job-tokens", "10.8e9")
    assert res.code == 0, res.text
    assert "job: 10,800,000,000 tokens at 21,934 tokens/s (colocated) = 136.8 h" in res.out
    res = cli("plan", path, "--rates", "7200,23000", "--gpus", "4", "--job-tokens", "10.8e9", "--json")
    import json

    job = json.loads(res.out)["job"]
    assert job["tokens"] == 10.8e9 and round(job["hours"], 1) == 136.8


RANKS = re.compile(r"pack and extract with ranks: (\S+), train and checkpoint with ranks: (\S+);")


@pytest.mark.parametrize("gpus", [2, 4, 6, 8])
def test_fan_in_ranks_are_what_the_pipeline_file_accepts(cli, write_pipeline, gpus):
    """Every split's printed ``ranks:`` go into a pipeline file as they are, and it validates."""
    for lay in plan(PlanInputs(RT, RD), gpus).fan_in_splits:
        producers, consumers = RANKS.search(lay.how).groups()
        assert f"--nproc_per_node {gpus};" in lay.how
        path = write_pipeline(f"""
            stages:
              pack: {{uses: "pack:random", ranks: {producers}, params: {{rows: 4, tokens_per_row: 64}}}}
              extract: {{uses: hf_hooks, after: pack, ranks: {producers},
                         params: {{model: "random:tiny", layers: [1]}}}}
              train: {{uses: dflash, after: extract, ranks: {consumers}, params: {{num_layers: 1}}}}
              checkpoint: {{uses: fsspec, after: train, ranks: {consumers}}}
        """, name=f"fan_in_{lay.target_gpus}_{lay.drafter_gpus}.yaml")
        res = cli("validate", path)
        assert res.code == 0, (lay.how, res.text)
    assert RANKS.search(plan(PlanInputs(RT, RD), 8).fan_in.how).groups() == ('"0-5"', '"6-7"')
    assert RANKS.search(plan(PlanInputs(RT, RD), 2).fan_in.how).groups() == ("[0]", "[1]")


def test_cli_refuses_what_it_cannot_measure(cli, write_pipeline):
    path = write_pipeline("""
        stages:
          src: {uses: numbers, params: {n: 3}}
    """)
    res = cli("plan", "-p", STAGES, path)
    assert res.code == 2 and "measuring needs the stages extract:hf_hooks and train:dflash" in res.err
    res = cli("plan", "-p", STAGES, path, "--rates", "100,200", "--gpus", "2")
    assert res.code == 0, res.text
    assert "feature row size unknown" in res.out and res.lines_with("│ pairs ", "100")
    with pytest.raises(SystemExit):
        cli("plan", path, "--rates", "7200")


def test_help_does_not_import_torch():
    code = ("import sys; from dflash_core.cli.main import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
