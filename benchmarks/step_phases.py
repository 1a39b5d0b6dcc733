"""Where a drafter training step's time goes, phase by phase (``train_step.py --breakdown``).

A ``PhaseClock`` takes marks while the step is enqueued: CUDA events recorded into the stream (on
the CPU, where every operation runs when it is called, the wall clock). ``phase_marks`` adds marks
inside the drafter from outside it: module hooks at its forward and its fc, wrappers around the two
compiled units every draft layer runs (attention half, MLP half) and, for the backward, tensor hooks
that fire when the gradient reaches the tensors between those units. The time between two marks
belongs to the phase the later mark names, so the phases add up to the step. The hooks only read
the clock: the step computes the same values with them (tests/benchmarks/test_benchmark_train_step.py).
Hooks go on tensors only after the compiled unit that reads them has run, so that no compiled
graph ever sees a hooked input (and none recompiles for it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

PREP = "anchors, blocks, labels"
FC = "fc (target features) fwd"
SETUP = "context norm, embedding, RoPE, mask fwd"
ATTN_FWD = "attention halves fwd (q/k/v/o, context K/V, attention)"
MLP_FWD = "MLP halves fwd"
NORM_FWD = "final norm fwd"
LOSS = "LM head + loss (both products, softmax passes)"
HEAD_BWD = "LM head bwd (saved gradient x scale)"
NORM_BWD = "final norm bwd"
MLP_BWD = "MLP halves bwd"
ATTN_BWD = "attention halves bwd"
FC_BWD = "context norm + fc bwd"
OPTIMIZER = "optimizer (clip + AdamW)"
ORDER = (PREP, FC, SETUP, ATTN_FWD, MLP_FWD, NORM_FWD, LOSS, HEAD_BWD, NORM_BWD, MLP_BWD, ATTN_BWD, FC_BWD,
         OPTIMIZER)
STEP_MARKS = {"forward": LOSS, "backward": FC_BWD, "optimizer": OPTIMIZER}
"""The step's own marks (after the loss, the backward and the optimizer) as breakdown phases."""


class PhaseClock:
    """Marks on the step's timeline; ``phases()`` sums the time before each mark under its name.

    ``wall``: each mark waits for the device and reads the host clock (the first step, whose
    time is mostly compilation on the host). ``names`` renames marks as they are taken."""

    def __init__(self, device: torch.device, wall: bool = False, names: dict[str, str] | None = None) -> None:
        self.device, self.names = device, names or {}
        self.events = device.type == "cuda" and not wall
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        """The time since the last mark is ``name``'s."""
        if self.events:
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            stamp = time.perf_counter()
        self.marks.append((self.names.get(name, name), stamp))

    def on_grad(self, t: torch.Tensor, name: str) -> None:
        """Mark ``name`` when the backward has formed ``t``'s gradient (nothing if it gets none)."""
        if t.requires_grad:
            t.register_hook(lambda _grad: self.mark(name))

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, in the order first seen; the marks are consumed."""
        if self.events and self.marks:
            self.marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = out.get(name, 0.0) + (a.elapsed_time(b) / 1e3 if self.events else b - a)
        self.marks = []
        return out


@contextmanager
def phase_marks(model: Any, clock: PhaseClock) -> Iterator[None]:
    """Marks inside ``model`` (a ``DFlashDrafter``) for as long as the context lasts."""
    attend, feed_forward = model._attend, model._feed_forward
    n_layers = len(model.layers)
    pending: list[tuple[torch.Tensor, str]] = []  # hooked when the forward is over
    calls = {"attend": 0, "feed_forward": 0}

    def timed_attend(layer: Any, x: torch.Tensor, ctx: torch.Tensor, *rest: Any) -> torch.Tensor:
        first = calls["attend"] % n_layers == 0
        clock.mark(SETUP if first else ATTN_FWD)
        out = attend(layer, x, ctx, *rest)
        clock.mark(ATTN_FWD)
        calls["attend"] += 1
        # backward: x's gradient is complete once this half's backward is done; the context's
        # once every layer's is, the first layer's last (its x, the embedding, has none)
        pending.append((x, ATTN_BWD))
        if first:
            pending.append((ctx, ATTN_BWD))
        return out

    def timed_feed_forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = feed_forward(layer, x)
        clock.mark(MLP_FWD)
        calls["feed_forward"] += 1
        pending.append((x, MLP_BWD))
        if calls["feed_forward"] % n_layers == 0:
            pending.append((out, NORM_BWD))
        return out

    def before(_module: Any, _args: Any) -> None:
        clock.mark(PREP)

    def after(_module: Any, _args: Any, out: torch.Tensor) -> None:
        clock.mark(NORM_FWD)
        for t, name in pending:
            clock.on_grad(t, name)
        pending.clear()
        clock.on_grad(out, HEAD_BWD)

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after),
               model.fc.register_forward_hook(lambda *_: clock.mark(FC))]
    model._attend, model._feed_forward = timed_attend, timed_feed_forward
    try:
        yield
    finally:
        model._attend, model._feed_forward = attend, feed_forward
        for h in handles:
            h.remove()


def breakdown(step: Callable[[Callable[[str], None]], Any], model: Any, dev: torch.device,
              n: int) -> dict[str, float]:
    """Median milliseconds of each phase over ``n`` steps; ``step(mark)`` runs one step, calling
    ``mark`` at its start and after its forward, backward and optimizer (``STEP_MARKS``)."""
    clock = PhaseClock(dev, names=STEP_MARKS)
    runs: list[dict[str, float]] = []
    with phase_marks(model, clock):
        for _ in range(n):
            step(clock.mark)
            runs.append(clock.phases())
    return {p: statistics.median(r.get(p, 0.0) for r in runs) * 1e3 for p in ORDER if any(p in r for r in runs)}


def breakdown_table(columns: dict[str, dict[str, float]]) -> list[str]:
    """One row per phase, one column (ms and share of the step) per breakdown."""
    names = list(dict.fromkeys(p for col in columns.values() for p in col))
    width = max(len(p) for p in [*names, "phase"])
    lines = [f"{'phase':{width}} " + " ".join(f"{h:>18}" for h in columns)]
    totals = {h: sum(col.values()) for h, col in columns.items()}
    for p in names:
        lines.append(f"{p:{width}} " + " ".join(
            f"{col.get(p, 0.0):9.2f} ms {col.get(p, 0.0) / totals[h] if totals[h] else 0.0:5.1%}"
            for h, col in columns.items()))
    lines.append(f"{'step (sum of phases)':{width}} " + " ".join(f"{totals[h]:9.2f} ms {'':6}" for h in columns))
    return lines
