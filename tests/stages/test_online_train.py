"""Online training end to end on CPU: pack:synthetic -> extract:hf_hooks -> train:dflash ->
checkpoint:fsspec with a tiny random-init Qwen3 target (tests/stages/online_fixtures.py).

- a short run learns (loss and tau_sim from metrics.jsonl) and its export loads back;
- SIGKILL at a random step + ``run --resume`` ends bit-identical to an uninterrupted run;
- 2 gloo ranks under torchrun train the same drafter as one process on the same global batch;
- ``run --resume`` without a checkpoint starts from the beginning and says so;
- ``run --resume`` of a finished run changes nothing, and ``latest.json`` never names a
  checkpoint that is being rewritten.

The CLI runs that must be killed or run under torchrun are subprocesses (one torch thread
each); the others run in this process to save the interpreter start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.runner import Runner, RunFailed
from tests.conftest import REPO, cli_env
from tests.stages import online_fixtures
from tests.stages.online_fixtures import CKPT_FILES, TINY_TRAIN, online_pipeline

PLUGIN = "tests.stages.online_fixtures"
BIN = Path(sys.executable).parent
TRAIN = dict(TINY_TRAIN, log_every=10)


# ------------------------------------------------------------------------------ helpers
def run_in_process(path: Path, **runner_kw: Any) -> dict[str, Any]:
    pm = PluginManager(autoload=True)
    pm.add_plugin(online_fixtures, PLUGIN)
    return Runner(load_pipeline(str(path), pm), pm, **runner_kw).run()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def launch(argv: list[str], log: Path, **env_vars: str) -> subprocess.Popen:
    """A CLI subprocess in its own process group (so SIGKILL reaches all of it), one torch
    thread, ``env_vars`` added to its environment, output to ``log``."""
    env = cli_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **env_vars)
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def dflash_pipe(pipeline: Path, *args: str) -> list[str]:
    return [str(BIN / "dflash-pipe"), "run", "-p", PLUGIN, str(pipeline), *args]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing torchrun's process group leaves them running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant, each by its pid."""
    below = descendants(proc.pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def finish(proc: subprocess.Popen, log: Path, timeout: float = 100) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        pytest.fail(f"{proc.args} timed out:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{text[-4000:]}"
    return text


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(ln) for ln in lines if ln.endswith("}")]  # the last may be half-written


def latest(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest.json"
    try:
        name = json.loads(pointer.read_text())["name"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return run_dir / "checkpoints" / name


def assert_complete(ckpt: Path) -> None:
    missing = [f for f in CKPT_FILES if not (ckpt / f).is_file()]
    assert not missing, f"latest.json points at {ckpt}, which lacks {missing}"


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, keyed by its relative path."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested dict/list, keyed by its path (tensors and plain values)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}{k}/"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}{i}/"))
        return out
    return {prefix.rstrip("/"): obj}


def load_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=True)


def assert_same_train_state(a_ckpt: Path, b_ckpt: Path, note: str = "") -> None:
    """Every leaf of the two checkpoints' train_state.pt is equal (tensors: torch.equal)."""
    a, b = flat_tensors(load_state(a_ckpt)), flat_tensors(load_state(b_ckpt))
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer/state/") for k in a) and "rng/0/cpu" in a
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{key} differs {note}"
        else:
            assert a[key] == b[key], key


# ---------------------------------------------------------------------------- learning
def test_short_run_learns_and_exports(tmp_path: Path, target: Path, monkeypatch) -> None:
    """60 steps of 2 rows: the last logged loss window is < 0.5 x the first and tau_sim rises
    by >= 0.5 (measured: loss ~17.5 -> ~2.4, tau_sim 1.0 -> ~2.1); the final export loads with
    ``load_drafter`` and its config.json carries the ``dflash_pipe`` metadata, with absolute
    paths although the file writes them relative to itself and the run starts elsewhere."""
    from dflash_model.drafter import load_drafter

    run_dir = tmp_path / "run"
    (tmp_path / "heldout.jsonl").write_text("")
    path = write(tmp_path / "p.yaml", online_pipeline(
        "run", target, pack=dict(rows=120, tokens_per_row=64),
        train=dict(TRAIN, lr=2e-2, num_anchors=32, rows_per_step=2, total_steps=200,
                   heldout="heldout.jsonl"),
        checkpoint=dict(every_steps=1000)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    results = run_in_process(path)
    assert list(elsewhere.iterdir()) == []
    assert all(r.status == "done" for r in results.values()), results
    log = metrics(run_dir)
    assert [m["step"] for m in log] == list(range(10, 61, 10))
    first, last = log[0], log[-1]
    assert last["loss"] < 0.5 * first["loss"], log
    assert last["tau_sim"] >= first["tau_sim"] + 0.5, log
    assert all(1 <= m["tau_serve"] <= m["tau_sim"] for m in log), log  # a harmonic mean is at most the mean
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [m["step"] for m in log]

    ckpt = latest(run_dir)
    assert ckpt is not None and ckpt.name == "step-0000060"
    assert_complete(ckpt)
    model = load_drafter(ckpt / "export", dtype=torch.float32)
    state = load_state(ckpt)["model"]
    for name, tensor in model.state_dict().items():  # export is bf16 of the trained weights
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16).float())
    config = json.loads((ckpt / "export" / "config.json").read_text())
    meta = config["dflash_pipe"]
    assert meta["target"] == str(target) and meta["step"] == 60
    assert meta["metrics"] == str(run_dir / "metrics.jsonl")
    assert meta["heldout"] == str(tmp_path / "heldout.jsonl")
    assert config["dflash_config"]["mask_token_id"] == 5999
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2]


# ------------------------------------------------------------------ kill and resume
STEPS, EVERY = 40, 10


@pytest.fixture
def one_thread():
    """One torch thread in this process, as in the ``OMP_NUM_THREADS=1`` subprocesses, so
    in-process and subprocess runs do the same floating-point work."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_sigkill_at_random_step_then_resume_is_bit_identical(tmp_path: Path, target: Path, cli,
                                                             one_thread) -> None:
    """A run SIGKILLed (whole process group) at a seeded-random step after the first checkpoint,
    then ``dflash-pipe run --resume``, ends with bit-identical drafter weights, optimizer state
    and RNG (torch.equal on every tensor of the final train_state.pt) to an uninterrupted run.
    After the kill, ``latest.json`` names a complete checkpoint.

    The killed run is a ``dflash-pipe`` subprocess; the uninterrupted run (meanwhile, in a
    thread) and ``run --resume`` (the CLI's ``main``) run in this process with one torch
    thread, which saves two interpreter start-ups."""
    kw = dict(pack=dict(rows=STEPS, tokens_per_row=64),
              train=dict(TRAIN, log_every=1), checkpoint=dict(every_steps=EVERY))
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_yaml = write(tmp_path / "ref.yaml", online_pipeline(ref_dir, target, **kw))
    run_yaml = write(tmp_path / "killed.yaml", online_pipeline(run_dir, target, **kw))
    # in the first half: the poll below must see the step before the run ends, and on a loaded
    # machine it has lagged the run by more than 5 steps
    kill_at = random.Random(20240611).randint(EVERY + 1, STEPS // 2)

    log = tmp_path / "killed.log"
    victim = launch(dflash_pipe(run_yaml), log)
    ref_results: dict[str, Any] = {}
    ref = threading.Thread(target=lambda: ref_results.update(run_in_process(ref_yaml)))
    ref.start()
    try:
        deadline = time.time() + 100
        while True:
            assert victim.poll() is None, (
                f"run ended before the kill at {kill_at}:\n{log.read_text()}")
            assert time.time() < deadline, "timed out waiting for the step to kill at"
            steps = metrics(run_dir)
            if steps and steps[-1]["step"] >= kill_at and latest(run_dir) is not None:
                break
            time.sleep(0.01)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            kill_all(victim)
        ref.join()
    killed_at = metrics(run_dir)[-1]["step"]
    assert victim.returncode == -signal.SIGKILL
    assert killed_at < STEPS
    assert ref_results and all(r.status == "done" for r in ref_results.values()), ref_results

    ckpt = latest(run_dir)
    assert ckpt is not None
    assert_complete(ckpt)
    resumed_from = int(json.loads((ckpt / "pipeline_state.json").read_text())["train"]["step"])
    assert EVERY <= resumed_from <= killed_at

    res = cli("run", "-p", PLUGIN, run_yaml, "--resume")
    assert res.code == 0, res.text
    assert f"resuming from {ckpt}" in res.text.replace("\n", ""), res.text

    # the resumed run continued from the checkpoint: metrics.jsonl keeps the records up to it,
    # not those the killed run logged after it, so each step is there once
    steps = [m["step"] for m in metrics(run_dir)]
    assert steps == list(range(1, STEPS + 1))

    final_ref, final_run = latest(ref_dir), latest(run_dir)
    assert final_ref.name == final_run.name == f"step-{STEPS:07d}"
    assert_same_train_state(final_ref, final_run, f"after resume from {resumed_from}")


# --------------------------------------------------------------------- data parallel
def test_two_gloo_ranks_match_one_process(tmp_path: Path, target: Path) -> None:
    """torchrun with 2 gloo ranks x ``rows_per_step: 1`` trains the same drafter as one process
    with ``rows_per_step: 2`` (same global batches: SyntheticRows gives rank r rows r, r+2, …,
    and anchors are seeded by the row's place in the global batch).

    Tolerance: max |difference| < 1e-5 on every drafter tensor after 8 steps, for the
    gradients may differ in summation order (accumulated backward of loss/2 per row vs.
    all-reduce of per-rank grads then /2); measured here: 0.0. Both ranks end with exactly
    equal weights (the debug:rank_states sink of online_fixtures dumps each rank's), and
    rank 1's RNG file lands in the checkpoint directory."""
    pack = dict(rows=16, tokens_per_row=64)
    ckpt = dict(every_steps=4)  # a checkpoint mid-run: its barriers interleave with training
    single_dir, multi_dir = tmp_path / "single", tmp_path / "multi"
    multi_yaml = write(tmp_path / "multi.yaml", online_pipeline(
        multi_dir, target, pack=pack, train=dict(TRAIN, rows_per_step=1), checkpoint=ckpt,
        extra="  ranks: {uses: 'debug:rank_states', after: train}\n"))
    log = tmp_path / "torchrun.log"
    proc = launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                   "-m", "dflash_core.cli.main", "run", "-p", PLUGIN, str(multi_yaml)], log)

    single_yaml = write(tmp_path / "single.yaml", online_pipeline(
        single_dir, target, pack=pack, train=dict(TRAIN, rows_per_step=2), checkpoint=ckpt))
    try:
        results = run_in_process(single_yaml)  # meanwhile, in this process
    finally:
        finish(proc, log, timeout=110)
    assert all(r.status == "done" for r in results.values()), results

    single, multi = latest(single_dir), latest(multi_dir)
    assert single.name == multi.name == "step-0000008"
    assert_complete(multi)
    assert (multi / "rng.rank1.pt").is_file()
    a, b = load_state(single)["model"], load_state(multi)["model"]
    assert a.keys() == b.keys()
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert max(diffs.values()) < 1e-5, diffs
    r0 = torch.load(multi_dir / "rank_states" / "rank0.pt", weights_only=True)
    r1 = torch.load(multi_dir / "rank_states" / "rank1.pt", weights_only=True)
    assert r0.keys() == r1.keys() == b.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks disagree on {k}"
        assert torch.equal(r0[k], b[k]), f"checkpoint is not rank 0's {k}"
    # each rank's report says so too (the check the trainer makes on GPUs, where no rank dumps)
    assert log.read_text().count("2 replicas equal") == 2


def test_two_gloo_ranks_take_several_steps_a_row_in_step(tmp_path: Path, target: Path) -> None:
    """``steps_per_row: 2`` on 2 gloo ranks: each rank takes 2 steps on each of its 8 rows (16
    steps, one all-reduce each), a checkpoint is written every 4 steps, and the replicas end with
    equal weights."""
    run_dir = tmp_path / "run"
    yaml_path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=16, tokens_per_row=64), train=dict(TRAIN, steps_per_row=2),
        checkpoint=dict(every_steps=4, keep_last=10), extra="  ranks: {uses: 'debug:rank_states', after: train}\n"))
    log = tmp_path / "torchrun.log"
    proc = launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                   "-m", "dflash_core.cli.main", "run", "-p", PLUGIN, str(yaml_path)], log)
    finish(proc, log, timeout=110)
    final = latest(run_dir)
    assert final.name == "step-0000016"
    assert_complete(final)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        f"step-{n:07d}" for n in (4, 8, 12, 16)]
    r0 = torch.load(run_dir / "rank_states" / "rank0.pt", weights_only=True)
    r1 = torch.load(run_dir / "rank_states" / "rank1.pt", weights_only=True)
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert log.read_text().count("2 replicas equal") == 2


# -------------------------------------------------------------- resume with nothing saved
def test_resume_without_checkpoint_starts_from_the_beginning(tmp_path: Path, target: Path, cli
                                                             ) -> None:
    """``run --resume`` on a fresh run dir says there is nothing to resume and trains from
    step 1 to the end."""
    run_dir = tmp_path / "run"
    path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=6, tokens_per_row=64), train=dict(TRAIN, log_every=1),
        checkpoint=dict(every_steps=3)))
    res = cli("run", "-p", PLUGIN, path, "--resume")
    assert res.code == 0, res.text
    assert "no complete checkpoint found: starting from the beginning" in res.text
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert latest(run_dir).name == "step-0000006"


# --------------------------------------------------------------- resume of a finished run
def finished_run(tmp_path: Path, target: Path) -> tuple[Path, Path]:
    """(pipeline file, run dir) of a 6-step run checkpointed every 3 steps, run to the end."""
    run_dir = tmp_path / "run"
    path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=6, tokens_per_row=64), train=dict(TRAIN, log_every=1),
        checkpoint=dict(every_steps=3)))
    results = run_in_process(path)
    assert all(r.status == "done" for r in results.values()), results
    assert latest(run_dir).name == "step-0000006"
    return path, run_dir


def test_resume_of_a_finished_run_changes_nothing(tmp_path: Path, target: Path, cli) -> None:
    """``run --resume`` after the last checkpoint of a finished run says the run is complete at
    step 6, exits 0 and leaves every file under the run dir byte-identical — twice in a row;
    ``status`` says where training finished."""
    path, run_dir = finished_run(tmp_path, target)
    before = tree_digest(run_dir)
    for _ in range(2):
        res = cli("run", "-p", PLUGIN, path, "--resume")
        assert res.code == 0, res.text
        assert "run already complete at step 6" in res.text.replace("\n", ""), res.text
        assert tree_digest(run_dir) == before
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert "(training finished at step 6)" in cli("status", "-p", PLUGIN, path).text


def test_resume_at_an_unmarked_last_checkpoint_keeps_it(tmp_path: Path, target: Path, cli) -> None:
    """A finished run whose ``latest.json`` does not say ``final`` (written before that flag
    existed, or killed between the last step's periodic checkpoint and the end of the run):
    ``run --resume`` trains 0 steps, leaves the checkpoint latest names byte-identical (its
    pipeline_state.json keeps pack's cursor), marks it final; the next ``--resume`` is a no-op."""
    path, run_dir = finished_run(tmp_path, target)
    ckpt = latest(run_dir)
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"name": ckpt.name, "step": 6}))
    kept = tree_digest(ckpt)
    res = cli("run", "-p", PLUGIN, path, "--resume")
    assert res.code == 0, res.text
    assert f"resuming from {ckpt}" in res.text.replace("\n", ""), res.text
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert latest(run_dir) == ckpt and tree_digest(ckpt) == kept
    assert json.loads((ckpt / "pipeline_state.json").read_text()) == {
        "pack": {"position": 6}, "train": {"step": 6}}
    res = cli("run", "-p", PLUGIN, path, "--resume")
    assert "run already complete at step 6" in res.text.replace("\n", ""), res.text
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_resume_into_a_last_partial_step_keeps_the_pack_cursor(tmp_path: Path, target: Path,
                                                               cli) -> None:
    """3 rows at 2 rows per step: step 1 is checkpointed, step 2 (one row) is the end of the run.
    Cut off before step 2's checkpoint (its directory gone, ``latest.json`` back on step 1),
    ``run --resume`` trains the last row and writes a step 2 equal to the uninterrupted one:
    the same pipeline_state.json (pack's cursor included) and the same train state."""
    run_dir = tmp_path / "run"
    path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=3, tokens_per_row=64), train=dict(TRAIN, rows_per_step=2),
        checkpoint=dict(every_steps=1)))
    run_in_process(path)
    ckpts = run_dir / "checkpoints"
    last = latest(run_dir)
    assert last.name == "step-0000002"
    whole = tmp_path / "uninterrupted"
    shutil.copytree(last, whole)
    assert "pack" in json.loads((whole / "pipeline_state.json").read_text())
    shutil.rmtree(last)
    (ckpts / "latest.json").write_text(json.dumps({"name": "step-0000001", "step": 1, "final": False}))
    res = cli("run", "-p", PLUGIN, path, "--resume")
    assert res.code == 0, res.text
    assert latest(run_dir) == last
    assert (last / "pipeline_state.json").read_text() == (whole / "pipeline_state.json").read_text()
    assert_same_train_state(whole, last, "after resume into the last step")


def test_rerun_never_leaves_latest_naming_a_removed_checkpoint(tmp_path: Path, target: Path,
                                                              monkeypatch) -> None:
    """A plain run (no ``--resume``) in a run dir whose ``latest.json`` names the step it saves
    next replaces that directory; cut off between removing the old one and renaming the new one
    into place (the rename fails here), ``latest.json`` names no missing or partial checkpoint.
    Run once more, it ends with latest naming the complete step."""
    run_dir = tmp_path / "run"
    path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=2, tokens_per_row=64), train=TRAIN,
        checkpoint=dict(every_steps=1000)))
    run_in_process(path)
    assert latest(run_dir).name == "step-0000002"
    rename = os.replace

    def cut(src: Any, dst: Any) -> None:
        if str(src).endswith(".tmp-save"):
            raise OSError("cut off before the rename")
        rename(src, dst)

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(RunFailed, match="cut off before the rename"):
        run_in_process(path)
    ckpt = latest(run_dir)
    if ckpt is not None:
        assert_complete(ckpt)
    monkeypatch.undo()
    run_in_process(path)
    assert latest(run_dir).name == "step-0000002"
    assert_complete(latest(run_dir))


def test_weights_digest_tells_equal_weights_from_one_ulp_apart() -> None:
    """The replica check compares these digests instead of the weights themselves."""
    from dflash_stages.train.trainer import weights_digest

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)

    a, b = model(), model()
    assert weights_digest(a) == weights_digest(b) and len(weights_digest(a)) == 32
    with torch.no_grad():
        b[1].weight.view(torch.int16)[3, 5] += 1  # the neighbouring bf16 value
    assert not torch.equal(a[1].weight, b[1].weight)
    assert weights_digest(a) != weights_digest(b)


@pytest.mark.parametrize("master_weights", [True, False])
def test_a_bf16_drafter_trains_its_norm_weights_with_master_weights(tmp_path: Path, target: Path,
                                                                   master_weights: bool) -> None:
    """The drafter in bf16, as on a GPU: with float32 master weights (the default) its norm weights
    leave 1.0; without them every update of a norm weight rounds away and they stay at 1.0."""
    path = write(tmp_path / "p.yaml", online_pipeline(
        tmp_path / "run", target, pack=dict(rows=8, tokens_per_row=64),
        train=dict(TRAIN, dtype="bfloat16", lr=1e-3, warmup_ratio=0.0, master_weights=master_weights),
        checkpoint=dict(every_steps=1000)))
    results = run_in_process(path)
    assert all(r.status == "done" for r in results.values()), results
    state = load_state(latest(tmp_path / "run"))["model"]
    norms = {k: v for k, v in state.items() if k.endswith("norm.weight")}
    assert norms and all(v.dtype == torch.bfloat16 for v in norms.values())
    moved = {k for k, v in norms.items() if (v != 1).any()}
    assert moved == (set(norms) if master_weights else set()), sorted(moved)
