"""Fan-in across torchrun ranks on CPU (gloo): extract on ranks 0 and 1 streams feature rows to
one drafter on rank 2 — the N -> M layout of the multi-GPU issue with N=2, M=1.

The drafter reads its producers round robin, which restores the global row order (row r went to
producer r mod 2), and its schedule counts both producers' rows; so it must end exactly where one
process running every stage ends.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_core.remote import decode, encode, route, slots
from tests.stages.online_fixtures import TINY_TRAIN
from tests.stages.test_online_train import (BIN, PLUGIN, finish, latest, launch, load_state, one_thread,  # noqa: F401
                                           run_in_process, write)

PACK = {"rows": 8, "tokens_per_row": 64}


def _yaml(run_dir: Path, target: Path, fan_in: bool, rows: int = 8) -> str:
    place = (lambda r: f", ranks: {r}") if fan_in else (lambda r: "")
    train = dict(TINY_TRAIN, log_every=2)
    return (f"version: 1\nrun_dir: {run_dir}\nstages:\n"
            f"  pack: {{uses: 'pack:synthetic', params: {json.dumps(dict(PACK, rows=rows))}{place('[0, 1]')}}}\n"
            f"  extract: {{uses: 'extract:hf_hooks', after: pack, params: {{model: '{target}', "
            f"layers: [0, 1, 2]}}{place('[0, 1]')}}}\n"
            f"  train: {{uses: 'train:dflash', after: extract, params: {json.dumps(train)}{place('[2]')}}}\n"
            f"  checkpoint: {{uses: 'checkpoint:fsspec', after: train, params: {{every_steps: 4}}"
            f"{place('[2]')}}}\n")


def test_two_extract_ranks_feed_one_drafter_like_one_process(tmp_path: Path, target: Path, one_thread) -> None:
    """The drafter fed by two extract ranks ends with the weights of one process running every
    stage (that process on one torch thread, as torchrun's workers are, so both do the same
    floating-point work)."""
    fan_dir, single_dir = tmp_path / "fan", tmp_path / "single"
    log = tmp_path / "torchrun.log"
    proc = launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "3",
                   "-m", "dflash_core.cli.main", "run", "-p", PLUGIN,
                   str(write(tmp_path / "fan.yaml", _yaml(fan_dir, target, True)))], log)
    try:
        results = run_in_process(write(tmp_path / "single.yaml", _yaml(single_dir, target, False)))
    finally:
        finish(proc, log, timeout=150)
    assert all(r.status == "done" for r in results.values()), results
    one, fan = latest(single_dir), latest(fan_dir)
    assert one.name == fan.name == "step-0000008"  # 8 rows, both producers' rows counted
    a, b = load_state(one), load_state(fan)
    assert a["step"] == b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"fan-in drafter differs on {k}"
    metrics = [json.loads(x) for x in (fan_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["tokens"] for m in metrics] == [64 * s for s in (2, 4, 6, 8)]
    # the drafter rank says what arrived and how fast: 8 rows, each row's tensors counted
    received = re.findall(r"received (\d+) row items from ranks \[0, 1\]: ([\d.]+) MB of tensors each, "
                          r"([\d.]+) ms per item", log.read_text())
    assert len(received) == 1 and received[0][0] == "8", received
    # a row's only tensor is its features: 64 tokens x 3 layers x hidden 64, float32 on CPU
    assert float(received[0][1]) * 1e6 == pytest.approx(64 * 3 * 64 * 4, rel=1e-3)


def test_route_deals_producers_round_robin():
    assert route((0, 1, 2), (3,)) == {3: [0, 1, 2]}
    assert route((0, 1, 2, 3), (4, 5)) == {4: [0, 2], 5: [1, 3]}


@pytest.mark.parametrize("cuda_ok", [False, True])
def test_wire_encoding_round_trip(cuda_ok):
    import pickle

    embed = torch.randn(5, 3)
    item = {"kind": "target", "embed_weight": embed, "lm_head_weight": embed,  # tied: sent once
            "rows": [torch.arange(4), {"x": torch.ones(2, 2, dtype=torch.bfloat16)}], "n": 3}
    blob, tensors = encode(item, cuda_ok)
    assert len(tensors) == 3
    structure = pickle.loads(blob)
    got = decode(structure, [t.clone() for t in tensors])
    assert [s.index for s in slots(structure)] == [0, 1, 2]
    assert got["embed_weight"] is got["lm_head_weight"] and torch.equal(got["embed_weight"], embed)
    assert torch.equal(got["rows"][0], torch.arange(4)) and got["rows"][1]["x"].dtype == torch.bfloat16
    assert got["n"] == 3 and got["kind"] == "target"


def test_fan_in_killed_mid_run_resumes_to_the_same_drafter(tmp_path: Path, target: Path, one_thread) -> None:
    """SIGKILL the whole 3-rank fan-in job after its step-4 checkpoint, then ``torchrun ... run
    --resume``: it continues from that checkpoint (every producer rank restarts at the row
    position the checkpoint recorded) and ends with the weights of one uninterrupted process."""
    import signal
    import time

    from tests.stages.test_online_train import kill_all

    fan_dir, single_dir = tmp_path / "fan", tmp_path / "single"
    fan_yaml = write(tmp_path / "fan.yaml", _yaml(fan_dir, target, True, rows=24))
    argv = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "3",
            "-m", "dflash_core.cli.main", "run", "-p", PLUGIN, str(fan_yaml)]
    victim = launch(argv, tmp_path / "killed.log")
    try:
        deadline = time.time() + 120
        while (latest(fan_dir) is None or latest(fan_dir).name != "step-0000004") and victim.poll() is None:
            assert time.time() < deadline, "no step-4 checkpoint in time"
            time.sleep(0.02)
        kill_all(victim)  # torchrun and every rank it started (they are in their own sessions)
        victim.wait()
    finally:
        if victim.poll() is None:
            kill_all(victim)
    time.sleep(1.0)  # nothing may still be writing
    ckpt = latest(fan_dir)
    assert victim.returncode == -signal.SIGKILL
    assert ckpt is not None and ckpt.name != "step-0000024", "the job ended before the kill"
    resumed = launch([*argv, "--resume"], tmp_path / "resumed.log")
    try:
        results = run_in_process(write(tmp_path / "single.yaml", _yaml(single_dir, target, False, rows=24)))
    finally:
        text = finish(resumed, tmp_path / "resumed.log", timeout=150)
    assert f"resuming from {ckpt}" in text.replace("\n", "")
    assert all(r.status == "done" for r in results.values()), results
    a, b = load_state(latest(single_dir)), load_state(latest(fan_dir))
    assert latest(fan_dir).name == "step-0000024" and b["step"] == 24
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"resumed fan-in drafter differs on {k}"
