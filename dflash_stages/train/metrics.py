"""What training reports as it goes: one metrics record per window of ``log_every`` steps.

:class:`MetricsLog` is the one place that knows the record: it gathers each step's statistics,
reads them back from the device once per window (a read every step would make the host wait for
the GPU), and writes the record to ``metrics.jsonl`` (rank 0), TensorBoard (when installed), the
progress display and the stage summary. ``dflash-pipe evaluate`` reads the JSONL back.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from time import monotonic, sleep  # bound here: tests set this module's ``time`` to a fixed clock
from time import time as unix_time
from typing import TYPE_CHECKING, Any

import torch

from dflash_core import StageContext
from dflash_stages.train.config import append_metrics, metrics_path, now, truncate_metrics

try:  # here, not when a run opens the log: the runner preloads this module in the main thread, and
    # a first import from the stage's thread, while another stage thread imports, can fail half-way
    from torch.utils.tensorboard import SummaryWriter
except ModuleNotFoundError:  # tensorboard not installed: JSONL metrics only
    SummaryWriter = None

if TYPE_CHECKING:
    from dflash_stages.train.trainer import StepStats

MEANS = ("loss", "acc", "tau_sim", "tau_serve")
"""The per-row statistics a record averages over its window."""
VAL_MEANS = ("loss", "acc", "tau_sim")
"""The per-row statistics a record averages over the window's validation rows."""
VALIDATION = tuple(f"val_{k}" for k in MEANS)
"""The same of the validation documents (``validation_share``), in windows that measured some:
``VAL_MEANS`` averaged over their rows, and ``val_tau_serve`` the τ of a served decode walked over
all their text (:class:`ServedWalk`), pooled over the window's cycles (``val_cycles`` of them)."""
SHOWN = ("step", "loss", "acc", "tau_sim", "lr", "grad_norm", "tokens_per_s")
"""The fields of the progress event (``step``: the trackers' x axis)."""
TENSORBOARD = ("loss", "acc", "tau_sim", "tau_serve", "lr", "grad_norm", "tokens_per_s") + VALIDATION


@dataclass
class ServedWalk:
    """The cycles a served decode would make on a row's validation text, from the τ at every one of
    its anchors: each supervised span (a response) walked from its first token, each cycle's anchor
    the last one's plus its τ (``cycles_on_text``, as evaluate's τ_ref walks the greedy reference).
    Why not the harmonic mean of ``tau_serve``: on served text it reads well below the served τ,
    where the walk follows it (docs/online_training.md, "Validation documents"). The τ stay on the
    device until :func:`walked_cycles` reads a window's at once."""

    anchors: list[int]
    """Every anchor of the row's validation tokens, in order."""
    block_tau: torch.Tensor
    """[len(anchors)] their τ, on the drafter's device."""
    spans: list[tuple[int, int]]
    """[start, end) of each run of supervised validation tokens within one document."""
    block_size: int
    max_new_tokens: int | None = None
    """The decode's budget from each span's start (evaluate's ``max_new_tokens``); None: the span's end."""


def walked_cycles(walks: list[ServedWalk]) -> list[tuple[int, bool]]:
    """(τ, whole block of budget) of every cycle of every span of ``walks``, their τ read back in one
    transfer. A cycle may draft up to the span's last token (a decode stops at the end token), so a
    span [start, end) is walked as a text whose budget ends at end + 1, or at start + the walk's
    ``max_new_tokens`` where that comes first."""
    from dflash_model.target.spec_decode import cycles_on_text

    taus = torch.cat([w.block_tau.detach().double() for w in walks]).tolist() if walks else []
    cycles, at = [], 0
    for w in walks:
        tau = dict(zip(w.anchors, taus[at:at + len(w.anchors)]))
        at += len(w.anchors)
        cap = w.max_new_tokens
        cycles += [c for start, end in w.spans
                   for c in cycles_on_text(tau, start, end + 1 if cap is None else min(end + 1, start + cap),
                                           w.block_size)]
    return cycles


class MetricsLog:
    """The metrics of one training run, on every rank alike; only rank 0 writes files."""

    def __init__(self, ctx: StageContext, every: int) -> None:
        self.ctx, self.every = ctx, every
        self.path = metrics_path(ctx)
        self.tb: Any = None
        self.window: list[dict[str, torch.Tensor]] = []
        self.val_window: list[dict[str, Any]] = []
        self.grad_norm: torch.Tensor | float = float("nan")
        self.epoch_steps: float | None = None
        """Optimizer steps an epoch of the data takes, once the trainer knows it: each record then
        says its ``epoch``, by which evaluate pools the last epoch's validation windows."""
        self.start()

    def open(self, step: int, resumed: bool) -> None:
        """Make the file and TensorBoard ready for the steps after ``step``: a resumed run keeps
        what was logged up to its checkpoint (the later steps are logged again), a fresh run
        starts them empty."""
        if self.ctx.rank != 0:
            return
        if resumed:
            truncate_metrics(self.path, step)
        elif "://" not in self.path and os.path.exists(self.path):
            os.remove(self.path)
        if "://" in self.ctx.run_dir or SummaryWriter is None:
            return
        logdir = os.path.join(self.ctx.run_dir, "tensorboard")
        after_earlier_event_files(logdir)
        self.tb = SummaryWriter(logdir, purge_step=step + 1 if resumed else None)

    def start(self) -> None:
        """Rates and elapsed time count from now (the loop's start, not the model's build)."""
        self.started = self.window_start = now()
        self.tokens = self.window_from = 0
        self.window_wait = 0.0

    def add(self, stats: StepStats, row_wait_s: float = 0.0) -> None:
        """A step's rows join the window (a stream's last, partial step's too); ``row_wait_s``: the
        seconds the loop waited for them."""
        self.tokens += stats.tokens
        self.window_wait += row_wait_s
        self.window += stats.row_stats
        self.val_window += stats.val_stats
        self.grad_norm = stats.grad_norm

    def stepped(self, step: int, total: int | None, stats: StepStats) -> None:
        """A whole step is done: the display counts it, and the window is written where it ends
        (every ``log_every`` steps, and at the schedule's last step)."""
        self.ctx.progress(1, total=total, unit="steps", tokens=stats.tokens)
        if step % self.every == 0 or step == total:
            self.write(step, stats.lr)

    def write(self, step: int, lr: float) -> None:
        """Write the window's record and start the next. A window without training anchors has no
        record, and what it measured on validation documents goes into the next one."""
        if self.window:
            self._write(self.record(step, lr))
            self.val_window = []
        self.window, self.window_from, self.window_start, self.window_wait = [], self.tokens, now(), 0.0

    def record(self, step: int, lr: float) -> dict[str, Any]:
        """The window's metrics record (``dflash_core.items.METRICS_RECORD``), as ``metrics.jsonl``
        holds it."""
        took = max(now() - self.window_start, 1e-9)
        rate = (self.tokens - self.window_from) / took
        means = _means(self.window)  # the one host sync of the window (the validation rows' after it)
        val = self._validation() if self.val_window else {}
        epoch = {"epoch": step / self.epoch_steps} if self.epoch_steps else {}
        return {"step": step, **epoch, **dict(zip(MEANS, means)), **val, "lr": lr, "grad_norm": float(self.grad_norm),
                "tokens_per_s": rate, "row_wait_share": min(self.window_wait / took, 1.0), "tokens": self.tokens,
                "elapsed_s": now() - self.started, "time": time.time(),
                "per_slot_acc": [round(a, 4) for a in self.window[-1]["per_slot_acc"].tolist()]}

    def _validation(self) -> dict[str, float]:
        """The window's ``VALIDATION`` figures (see there)."""
        from dflash_model.target.spec_decode import served_pool

        val = {f"val_{k}": v for k, v in zip(VAL_MEANS, _means(self.val_window, VAL_MEANS))}
        pool = served_pool(walked_cycles([v["walk"] for v in self.val_window]))
        val["val_tau_serve"] = sum(pool) / len(pool) if pool else float("nan")
        val["val_cycles"] = len(pool)
        return val

    def _write(self, record: dict[str, Any]) -> None:
        self.ctx.summary.update(loss=round(record["loss"], 4), tau_sim=round(record["tau_sim"], 3),
                                acc=round(record["acc"], 4))
        if "val_tau_serve" in record:
            self.ctx.summary.update(val_tau_serve=round(record["val_tau_serve"], 3),
                                    val_acc=round(record["val_acc"], 4))
        self.ctx.emit({"type": "metrics", **{k: record[k] for k in SHOWN}})
        if self.ctx.rank == 0:
            append_metrics(self.path, record)
            if self.tb is not None:
                for key in (k for k in TENSORBOARD if k in record):
                    self.tb.add_scalar(f"train/{key}", record[key], record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def after_earlier_event_files(logdir: str, limit_s: float = 3.0) -> None:
    """Return once a TensorBoard event file made now sorts after every one in ``logdir``.

    TensorBoard reads a directory's event files in name order, and a name holds the second it was
    made, then the host and the process id as text. A resumed run's file made within the same
    second as the interrupted run's can sort first, so its steps would be read before the earlier
    ones. This waits for the next second, at most ``limit_s`` (a file stamped later than that means
    the clock was set back)."""
    names = os.listdir(logdir) if os.path.isdir(logdir) else []
    stamps = [int(parts[3]) for parts in (name.split(".") for name in names)
              if parts[:3] == ["events", "out", "tfevents"] and len(parts) > 3 and parts[3].isdigit()]
    deadline = monotonic() + limit_s
    while stamps and int(unix_time()) <= max(stamps) and monotonic() < deadline:
        sleep(0.05)


def _means(window: list[dict[str, Any]], keys: tuple[str, ...] = MEANS) -> list[float]:
    """Each of ``keys`` averaged over the rows of a window, read back in one transfer."""
    return torch.stack([torch.stack([w[k].double() for k in keys]) for w in window]).mean(0).tolist()
