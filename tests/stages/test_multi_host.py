"""Training across hosts on CPU: two torchrun launchers on this machine (``--nnodes 2
--nproc-per-node 2`` or ``3``, rendezvous on 127.0.0.1, gloo) stand for two hosts of 2 or 3 GPUs.

On the second host LOCAL_RANK (0, 1) differs from RANK (2, 3), which a single-host run cannot
show: devices must follow the local rank (``cpu:{local_rank}`` here, ``cuda:{local_rank}`` on
GPUs), stage placement (``ranks:``) and data shards the global rank. The probes of
tests/stages/multi_host_probe.py record each rank's stages, devices and trained rows.

- colocated, 4 replicas (c10d rendezvous): every rank runs every stage on its local device,
  rank r trains rows r, r+4, …, each row once, and the replicas end equal;
- fan-in 4→2 across two hosts of 3 ranks (static rendezvous, ``--node-rank``): ranks 0-3
  extract, ranks 4 and 5 (local ranks 1 and 2 of host 1) train, each row once, and checkpoint
  (which hung before their checkpoint barrier was made by the drafter ranks alone);
- host 1's launcher SIGKILLed after a checkpoint stops host 0's too; ``--resume`` on both ends
  bit-identical to the uninterrupted colocated run; this run's run dir is on S3 (moto), shared
  as it must be by hosts without a common disk.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.stages.multi_host_probe import PROBE_ENV, read_probe
from tests.stages.online_fixtures import CKPT_FILES, TINY_TRAIN
from tests.stages.test_online_train import (BIN, assert_complete, assert_same_train_state, finish, kill_all,
                                            latest, launch, write)

PROBE = "tests.stages.multi_host_probe"
BUCKET = "multi-host"
HOSTS, PER_HOST = 2, 2  # the colocated runs; the fan-in run has 3 ranks a host
WORLD = HOSTS * PER_HOST
COLOCATED_ROWS = 24  # 6 steps of 4 replicas x 1 row; checkpoints at 2, 4, 6
FAN_IN_ROWS = 16  # 4 per producer rank; 4 steps of 2 rows on each of the 2 drafters
TIMEOUT = 150.0
STOP_TIMEOUT = 60.0  # measured: host 0 stops 1 s after host 1 is killed


def pipeline(run_dir: Path | str, target: Path, rows: int, train: dict, place: dict[str, str] | None = None) -> str:
    """pack:indexed -> extract (cpu:{local_rank}) -> train:probed (cpu:{local_rank}) -> checkpoint
    every 2 steps; ``place``: stage -> its ``ranks:`` (all ranks where absent)."""
    place = place or {}

    def ranks(stage: str) -> str:
        return f", ranks: {place[stage]}" if stage in place else ""

    device = ", device: 'cpu:{local_rank}'"
    return (f"version: 1\nrun_dir: {run_dir}\nstages:\n"
            f"  pack: {{uses: 'pack:indexed', params: {json.dumps({'rows': rows, 'tokens_per_row': 64})}"
            f"{ranks('pack')}}}\n"
            f"  extract: {{uses: 'extract:hf_hooks', after: pack{device}, params: {{model: '{target}', "
            f"layers: [0, 1, 2]}}{ranks('extract')}}}\n"
            f"  train: {{uses: 'train:probed', after: extract{device}, "
            f"params: {json.dumps(dict(TINY_TRAIN, **train))}{ranks('train')}}}\n"
            f"  checkpoint: {{uses: 'checkpoint:fsspec', after: train, params: {{every_steps: 2}}"
            f"{ranks('checkpoint')}}}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_hosts(yaml: Path, logs: Path, probe: Path, *args: str, static: bool = False,
              per_host: int = PER_HOST) -> list[subprocess.Popen]:
    """One torchrun launcher per host, output in ``logs/host<node>.log``. They meet at a c10d
    rendezvous on a free port, which numbers the hosts itself; ``static``: at host 0's store with
    ``--node-rank``, so host n gets ranks n × per_host, …"""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    common = ["--nnodes", str(HOSTS), "--nproc-per-node", str(per_host)]
    rdzv = (["--master-addr", "127.0.0.1", "--master-port", port] if static else
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex[:12]])
    return [launch([str(BIN / "torchrun"), *common, *rdzv, *(["--node-rank", str(node)] if static else []),
                    "-m", "dflash_core.cli.main", "run", "-p", PROBE, str(yaml), *args],
                   logs / f"host{node}.log", **{PROBE_ENV: str(probe)})
            for node in range(HOSTS)]


def finish_hosts(hosts: list[subprocess.Popen], logs: Path) -> str:
    """Both launchers' logs once both exited 0 (each killed with its workers if it did not)."""
    try:
        return "".join(finish(h, logs / f"host{node}.log", timeout=TIMEOUT) for node, h in enumerate(hosts))
    finally:
        for h in hosts:
            if h.poll() is None:
                kill_all(h)


def local_device(rank: int, per_host: int = PER_HOST) -> str:
    return f"cpu:{rank % per_host}"  # each host holds per_host consecutive ranks


@dataclass
class Run:
    run_dir: Path
    probe: Path
    log: str


def run_two_hosts(root: Path, target: Path, rows: int, train: dict, place: dict[str, str] | None = None,
                  static: bool = False, per_host: int = PER_HOST) -> Run:
    root.mkdir(parents=True, exist_ok=True)
    yaml = write(root / "pipe.yaml", pipeline(root / "run", target, rows, train, place))
    hosts = two_hosts(yaml, root, root / "probe", static=static, per_host=per_host)
    return Run(root / "run", root / "probe", finish_hosts(hosts, root))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Run:
    """The uninterrupted colocated run: 4 replicas over two hosts."""
    return run_two_hosts(tmp_path_factory.mktemp("colocated"), target, COLOCATED_ROWS, {"rows_per_step": 1})


def stages_by_rank(probe: Path, per_host: int = PER_HOST) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for rec in read_probe(probe, "stages"):
        assert rec["local_rank"] == rec["rank"] % per_host and rec["group_rank"] == rec["rank"] // per_host, rec
        out.setdefault(rec["rank"], {})[rec["stage"]] = rec["device"]
    return out


def test_colocated_on_two_hosts(colocated: Run) -> None:
    devices = stages_by_rank(colocated.probe)
    assert sorted(devices) == list(range(WORLD))
    for rank, stages in devices.items():
        assert set(stages) == {"pack", "extract", "train", "checkpoint"}, (rank, stages)
        assert stages["extract"] == stages["train"] == local_device(rank), (rank, stages)
    trained = {rec["rank"]: rec for rec in read_probe(colocated.probe, "trained")}
    assert sorted(trained) == list(range(WORLD))
    for rank, rec in trained.items():  # the shard of global rank r: rows r, r+4, ...
        assert rec["stage_rank"] == rank and rec["device"] == local_device(rank)
        assert rec["rows"] == list(range(rank, COLOCATED_ROWS, WORLD)), rec
    every = sorted(r for rec in trained.values() for r in rec["rows"])
    assert every == list(range(COLOCATED_ROWS))  # no row twice, none skipped
    # each rank's trainer compared the replicas' weight digests at the end
    assert colocated.log.count(f"{WORLD} replicas equal") == WORLD, colocated.log[-3000:]
    ckpt = latest(colocated.run_dir)
    assert ckpt is not None and ckpt.name == f"step-{COLOCATED_ROWS // WORLD:07d}"
    assert_complete(ckpt)
    assert sorted(p.name for p in ckpt.glob("rng.rank*.pt")) == [f"rng.rank{r}.pt" for r in range(1, WORLD)]


def test_fan_in_four_to_two_across_hosts(tmp_path: Path, target: Path) -> None:
    """Two hosts of 3 ranks: ranks 0-2 (host 0) and 3 (host 1, local rank 0) extract; ranks 4 and 5
    (host 1, local ranks 1 and 2) are the drafter replicas, fed by producers 0, 2 and 1, 3 round
    robin: rows r, r+2, … of the 16, each once. Their checkpoints synchronise on the drafter ranks
    alone. The static rendezvous (``--node-rank``) is the other way to launch; it pins the hosts' ranks."""
    producers, drafters = "'0-3'", "[4, 5]"
    run = run_two_hosts(tmp_path, target, FAN_IN_ROWS, {"rows_per_step": 2},
                        {"pack": producers, "extract": producers, "train": drafters, "checkpoint": drafters},
                        static=True, per_host=3)
    assert (tmp_path / "host1.log").read_text().count("train: 4 steps") == 2  # --node-rank 1 got ranks 4, 5
    devices = stages_by_rank(run.probe, per_host=3)
    assert {r: set(s) for r, s in devices.items()} == {
        **{r: {"pack", "extract"} for r in range(4)}, 4: {"train", "checkpoint"}, 5: {"train", "checkpoint"}}
    for rank, stages in devices.items():  # on its host's device: extract on 0, 1, 2, 0; train on 1, 2
        assert stages.get("extract", stages.get("train")) == local_device(rank, 3), (rank, stages)
    trained = read_probe(run.probe, "trained")
    assert [(rec["rank"], rec["local_rank"], rec["device"], rec["stage_rank"]) for rec in trained] == [
        (4, 1, "cpu:1", 0), (5, 2, "cpu:2", 1)]
    for rec in trained:
        assert rec["rows"] == list(range(rec["stage_rank"], FAN_IN_ROWS, 2)), rec
    assert sorted(r for rec in trained for r in rec["rows"]) == list(range(FAN_IN_ROWS))
    assert run.log.count("received 8 row items from ranks") == 2
    assert run.log.count("2 replicas equal") == 2
    ckpt = latest(run.run_dir)
    assert ckpt is not None and ckpt.name == "step-0000004"
    assert_complete(ckpt)
    assert (ckpt / "rng.rank1.pt").is_file()  # the second drafter's, from the stage's own rank 1


def s3_latest(fs: Any) -> str | None:
    """The checkpoint ``latest.json`` names in the S3 run dir, None before the first."""
    try:
        return json.loads(fs.cat(f"{BUCKET}/run/checkpoints/latest.json"))["name"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_killing_one_host_stops_the_job_and_resume_on_both_is_bit_identical(
        tmp_path: Path, target: Path, colocated: Run, s3_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run dir is on S3 (moto on 127.0.0.1), as for hosts that share no disk: rank 0 and the
    other ranks write each checkpoint's files there, and ``--resume`` reads them back on both."""
    fs = s3_env.fs()
    fs.mkdir(BUCKET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint_url)  # the launchers inherit it
    yaml = write(tmp_path / "pipe.yaml", pipeline(f"s3://{BUCKET}/run", target, COLOCATED_ROWS, {"rows_per_step": 1}))
    reference = latest(colocated.run_dir)
    hosts = two_hosts(yaml, tmp_path / "killed", tmp_path / "probe")
    try:
        deadline = time.monotonic() + TIMEOUT
        while s3_latest(fs) is None and all(h.poll() is None for h in hosts):
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        kill_all(hosts[1])  # host 1: its launcher and both its workers
        # host 0's workers lose their peers in the next collective: its launcher must exit by itself
        try:
            hosts[0].wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"host 0 still runs {STOP_TIMEOUT:.0f} s after host 1 was killed:\n"
                        + (tmp_path / "killed" / "host0.log").read_text()[-3000:])
    finally:
        for h in hosts:
            if h.poll() is None:
                kill_all(h)
    assert hosts[0].returncode not in (0, None), (tmp_path / "killed" / "host0.log").read_text()[-3000:]
    killed_at = s3_latest(fs)
    assert killed_at is not None and killed_at != reference.name, "the job ended before the kill"

    log = finish_hosts(two_hosts(yaml, tmp_path / "resumed", tmp_path / "probe", "--resume"), tmp_path / "resumed")
    assert log.replace("\n", "").count(f"resuming from s3://{BUCKET}/run/checkpoints/{killed_at}") == WORLD
    assert log.count(f"{WORLD} replicas equal") == WORLD
    assert s3_latest(fs) == reference.name
    remote = f"{BUCKET}/run/checkpoints/{reference.name}"
    assert all(fs.exists(f"{remote}/{f}") for f in CKPT_FILES), fs.find(remote)
    resumed = tmp_path / "resumed" / reference.name
    resumed.mkdir()
    for name in ["train_state.pt", *(f"rng.rank{r}.pt" for r in range(1, WORLD))]:
        (resumed / name).write_bytes(fs.cat(f"{remote}/{name}"))
    assert_same_train_state(reference, resumed, "after the kill and --resume")
    for r in range(1, WORLD):  # every replica's RNG too
        a, b = (torch.load(c / f"rng.rank{r}.pt", weights_only=True)["rng"][str(r)]["cpu"]
                for c in (reference, resumed))
        assert torch.equal(a, b), f"rank {r}'s RNG state differs"
