"""Where training stops short of the data: at ``total_steps``, and on SIGINT/SIGTERM.

- ``total_steps: N`` trains N steps (not the rows the data has), the LR schedule spans those N,
  the last step is checkpointed as final, and the stream stages feeding train stop with it;
- a ``dflash-pipe run`` sent SIGTERM or SIGINT saves a checkpoint at the next step, exits
  143 / 130 printing the command that resumes it, ``status`` says where it stopped, and
  ``run --resume`` then ends bit-identical to an uninterrupted run, with every step logged
  once (metrics.jsonl and TensorBoard) and the progress counting on from the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dflash_core.progress import Display
from dflash_stages.train.config import TrainConfig, lr_at
from tests.stages.online_fixtures import online_pipeline
from tests.stages.test_online_train import (PLUGIN, TRAIN, assert_complete, assert_same_train_state,
                                            dflash_pipe, kill_all, latest, launch, metrics,
                                            one_thread, run_in_process, write)  # noqa: F401


def test_total_steps_stops_training_and_spans_the_schedule(tmp_path: Path, target: Path) -> None:
    """60 rows, ``total_steps: 6``: steps 1-6 are logged with the rates of a 6-step schedule,
    the step-6 checkpoint is final, the progress reads 6/6 steps, and pack stopped early (the
    queues hold a few rows, far from all 60)."""
    run_dir = tmp_path / "run"
    params = dict(TRAIN, log_every=1, total_steps=6, warmup_ratio=0.34)
    path = write(tmp_path / "p.yaml", online_pipeline(
        run_dir, target, pack=dict(rows=60, tokens_per_row=64), train=params,
        checkpoint=dict(every_steps=1000)))
    display = Display(console=Console(quiet=True))
    results = run_in_process(path, display=display)
    assert all(r.status == "done" for r in results.values()), results
    log = metrics(run_dir)
    assert [m["step"] for m in log] == [1, 2, 3, 4, 5, 6]
    cfg = TrainConfig(**params)
    assert [m["lr"] for m in log] == [lr_at(s, 6, cfg) for s in range(6)]
    assert log[-1]["lr"] < 0.2 * cfg.lr  # the cosine is near its end, not at 6/60 of it
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text()) == {
        "name": "step-0000006", "step": 6, "final": True}
    task = display.task("train")
    assert (task.completed, task.total) == (6, 6)
    assert results["pack"].items < 60


# ------------------------------------------------------------------------ interrupts
STEPS = 40


def interrupt_pipeline(run_dir: Path, target: Path) -> str:
    """40 one-row steps, every step logged; no periodic checkpoint before the end."""
    return online_pipeline(run_dir, target, pack=dict(rows=STEPS, tokens_per_row=64),
                           train=dict(TRAIN, log_every=1), checkpoint=dict(every_steps=1000))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Path:
    """The final checkpoint of the same run, never interrupted (one torch thread, as the
    ``OMP_NUM_THREADS=1`` subprocess, so both do the same floating-point work)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_in_process(write(root / "p.yaml", interrupt_pipeline(root / "run", target)))
    finally:
        torch.set_num_threads(old)
    return latest(root / "run")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_and_resume_finishes_the_run(
        tmp_path: Path, target: Path, cli, one_thread, uninterrupted: Path, sig: int) -> None:
    """SIGTERM (to the process, as a scheduler) or SIGINT (to its process group, as a terminal's
    Ctrl-C) once step 5 is logged: exit 128 + signal, a complete checkpoint of the step reached
    that ``latest.json`` marks interrupted, metrics up to that step, the resume command in the
    output and in ``status``. ``run --resume`` then trains the rest: each step logged once, the
    progress counting from the checkpoint's step, the final train state equal to the
    uninterrupted run's."""
    run_dir = tmp_path / "run"
    path = write(tmp_path / "p.yaml", interrupt_pipeline(run_dir, target))
    log = tmp_path / "run.log"
    proc = launch(dflash_pipe(path), log)
    try:
        deadline = time.time() + 100
        while not (metrics(run_dir) and metrics(run_dir)[-1]["step"] >= 5):
            assert proc.poll() is None, f"run ended before the signal:\n{log.read_text()}"
            assert time.time() < deadline, "timed out waiting for step 5"
            time.sleep(0.01)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    text = log.read_text()
    assert proc.returncode == 128 + sig, text

    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    step = pointer["step"]
    assert 5 <= step < STEPS, text
    assert pointer == {"name": f"step-{step:07d}", "step": step, "final": False, "interrupted": True}
    assert_complete(latest(run_dir))
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, step + 1))
    command = f"dflash-pipe run -p {PLUGIN} {path} --resume"
    name = signal.Signals(sig).name
    assert f"{name}: interrupted at step {step}, checkpoint saved: {latest(run_dir)}" in text, text
    assert f"resume with: {command}" in text, text
    assert "send it again to abort at once" in text, text
    status = cli("status", "-p", PLUGIN, path).text.replace("\n", "")
    assert f"the run was interrupted at step {step}; continue it with: {command}" in status, status

    res = cli("run", "-p", PLUGIN, path, "--resume")
    assert res.code == 0, res.text
    first = next(ln for ln in res.text.splitlines() if ln.startswith("[train] ") and " steps" in ln)
    assert first.startswith(f"[train] {step} steps"), res.text
    steps = list(range(1, STEPS + 1))
    assert [m["step"] for m in metrics(run_dir)] == steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == steps
    assert latest(run_dir).name == uninterrupted.name == f"step-{STEPS:07d}"
    assert_same_train_state(uninterrupted, latest(run_dir), f"after the {name} at step {step}")
    assert "interrupted" not in json.loads((run_dir / "checkpoints" / "latest.json").read_text())
