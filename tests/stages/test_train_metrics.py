"""The trainer's metrics log: one record per window of ``log_every`` steps (and one for what is left
at the end), with the window's means, the last step's LR and gradient norm, and the window's rate,
written to metrics.jsonl, sent as a metrics event and kept in the summary; a resumed run keeps the
records up to its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash_core import StageContext
from dflash_core.items import METRICS_RECORD
from dflash_stages.train import metrics
from dflash_stages.train.metrics import MetricsLog, ServedWalk
from dflash_stages.train.trainer import StepStats


def stats(losses: list[float], tokens: int, lr: float, grad_norm: float) -> StepStats:
    """A step whose rows had these losses (accuracy half the loss, τ_sim 1 + the loss, τ_serve 1)."""
    rows = [{"loss": torch.tensor(x), "acc": torch.tensor(x / 2, dtype=torch.float64),
             "tau_sim": torch.tensor(1 + x, dtype=torch.float64), "tau_serve": torch.tensor(1.0, dtype=torch.float64),
             "per_slot_acc": torch.tensor([x, 0.123456], dtype=torch.float64)} for x in losses]
    return StepStats(rows=len(rows), tokens=tokens, row_stats=rows, anchors=[], grad_norm=torch.tensor(grad_norm),
                     lr=lr)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The log's clocks, set by the test: [perf counter seconds, Unix time]."""
    now = [0.0, 1.7e9]
    monkeypatch.setattr(metrics, "now", lambda: now[0])
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: now[1]))
    return now


def test_a_record_per_window_and_one_for_the_rest(tmp_path: Path, clock: list[float]) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    ctx = StageContext(stage="train", config=None, run_dir=str(tmp_path), work_dir=str(tmp_path),
                       emitter=lambda stage, event: events.append((stage, event)))
    log = MetricsLog(ctx, every=2)
    log.open(0, resumed=False)
    log.start()
    clock[0] = 1.0
    for step, done in enumerate([stats([1.0, 3.0], 100, 0.5, 4.0), stats([2.0], 60, 0.25, 2.0)], start=1):
        log.add(done, row_wait_s=0.25)  # the loop waited 0.5 s of the window's 1 s for its rows
        log.stepped(step, None, done)
    clock[:] = [4.0, 1.7e9 + 4]
    last = stats([0.5], 30, 0.125, 1.0)
    log.add(last, row_wait_s=0.75)  # a last, partial step: no stepped(), written by the closing write
    log.write(3, 0.0625)
    log.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 2, "loss": 2.0, "acc": 1.0, "tau_sim": 3.0, "tau_serve": 1.0, "lr": 0.25, "grad_norm": 2.0,
         "tokens_per_s": 160.0, "row_wait_share": 0.5, "tokens": 160,
         "elapsed_s": 1.0, "time": 1.7e9, "per_slot_acc": [2.0, 0.1235]},
        {"step": 3, "loss": 0.5, "acc": 0.25, "tau_sim": 1.5, "tau_serve": 1.0, "lr": 0.0625, "grad_norm": 1.0,
         "tokens_per_s": 10.0, "row_wait_share": 0.25, "tokens": 190,
         "elapsed_s": 4.0, "time": 1.7e9 + 4, "per_slot_acc": [0.5, 0.1235]},
    ]
    assert all(METRICS_RECORD.matches(r) for r in records)
    shown = [e for _, e in events if e["type"] == "metrics"]
    assert shown == [{"type": "metrics", **{k: r[k] for k in metrics.SHOWN}} for r in records]
    assert ctx.summary == {"loss": 0.5, "tau_sim": 1.5, "acc": 0.25}


def test_a_resumed_log_keeps_the_records_up_to_its_step(tmp_path: Path, clock: list[float]) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (10, 20, 30)) + '{"step": 4')
    ctx = StageContext(stage="train", config=None, run_dir=str(tmp_path), work_dir=str(tmp_path))
    log = MetricsLog(ctx, every=10)
    log.open(20, resumed=True)
    log.close()
    assert path.read_text() == '{"step": 10}\n{"step": 20}\n'
    fresh = MetricsLog(ctx, every=10)
    fresh.open(0, resumed=False)  # a fresh run in the same directory starts it anew
    fresh.close()
    assert not path.exists()


def test_validation_documents_are_averaged_into_the_next_record_that_is_written(tmp_path: Path,
                                                                                 clock: list[float]) -> None:
    """val_* average what the window measured on validation documents; a window that trained on
    nothing (every document of its rows a validation one) writes no record, and what it measured
    joins the next record instead of being lost."""
    log = MetricsLog(StageContext(stage="train", config=None, run_dir=str(tmp_path), work_dir=str(tmp_path)),
                     every=1)
    log.open(0, resumed=False)
    log.epoch_steps = 2.0

    def val(tau: float) -> dict[str, Any]:  # a 40-token response with τ at every anchor
        return {"loss": torch.tensor(tau), "acc": torch.tensor(0.5), "tau_sim": torch.tensor(tau),
                "walk": ServedWalk(list(range(39)), torch.full((39,), tau), [(0, 40)], 16)}

    steps = [stats([1.0], 10, 0.1, 1.0), stats([], 0, 0.1, 1.0), stats([2.0], 10, 0.1, 1.0), stats([3.0], 10, 0.1, 1.0)]
    steps[0].val_stats.append(val(2.0))
    steps[1].val_stats += [val(3.0), val(5.0)]  # nothing trained: no record of its own
    for step, done in enumerate(steps, start=1):
        log.add(done)
        log.stepped(step, None, done)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 4]
    # pooled over the window's cycles with a whole block of budget (drafts up to the last token, 39:
    # anchor <= 39 - 15): τ 3 at 0, 3, ..., 24 (9 cycles) and τ 5 at 0, 5, ..., 20 (5), not the rows' mean
    assert [r.get("val_tau_serve") for r in records] == [2.0, pytest.approx(52 / 14), None]
    assert [r.get("val_cycles") for r in records] == [13, 14, None]  # τ 2 at 0, 2, ..., 24
    assert [r["epoch"] for r in records] == [0.5, 1.5, 2.0]
    assert [r.get("val_tau_sim") for r in records] == [2.0, 4.0, None]
    assert all(METRICS_RECORD.matches(r) for r in records)


def test_evaluate_pools_the_last_epochs_validation_windows_by_their_cycles() -> None:
    """tau_serve_val is the walk over every validation document of the last epoch: the windows whose
    epoch lies within one of the last record's, each weighted by its cycles; a log without epochs
    or cycles (an older one) gives its last window's figure."""
    from dflash_stages.evaluate.drafter import training_summary

    def rec(epoch: float, tau: float | None = None, cycles: int | None = None) -> dict[str, Any]:
        val = {} if tau is None else {"val_tau_serve": tau, "val_cycles": cycles, "val_acc": 0.5}
        return {"step": round(epoch * 10), "epoch": epoch, "loss": 1.0, **val}

    records = [rec(0.5, 9.0, 100), rec(1.0, 4.0, 10), rec(1.2, 2.0, 30), rec(1.6), rec(1.9, 5.0, 10), rec(2.0)]
    out = training_summary(records)
    assert out["tau_serve_val"] == pytest.approx((2.0 * 30 + 5.0 * 10) / 40)  # epoch 1.0 is not after 2.0 - 1
    assert out["val_cycles"] == 40
    older = [{k: v for k, v in r.items() if k not in ("epoch", "val_cycles")} for r in records]
    assert training_summary(older)["tau_serve_val"] == 5.0 and "val_cycles" not in training_summary(older)


def test_a_resumed_runs_event_file_is_read_after_the_interrupted_runs(tmp_path: Path) -> None:
    """TensorBoard orders event files by name: time to the second, then host and process id as text.
    The interrupted run's file here is stamped a second ahead under a process id that sorts after
    any real one; the resumed run's steps must still be read after its."""
    import os
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    first = SummaryWriter(str(tmp_path / "first"))
    for step in (1, 2, 3):
        first.add_scalar("train/loss", float(step), step)
    first.close()
    (made,) = os.listdir(tmp_path / "first")
    logdir = tmp_path / "tensorboard"
    logdir.mkdir()
    os.rename(tmp_path / "first" / made, logdir / f"events.out.tfevents.{int(time.time()) + 1:010d}.host.999999999.0")

    ctx = StageContext(stage="train", config=None, run_dir=str(tmp_path), work_dir=str(tmp_path))
    log = MetricsLog(ctx, every=1)
    log.open(3, resumed=True)
    for step in (4, 5):
        log.tb.add_scalar("train/loss", float(step), step)
    log.close()
    events = EventAccumulator(str(logdir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
