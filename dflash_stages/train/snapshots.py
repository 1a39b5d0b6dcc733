"""When the trainer hands its state to the checkpoint stage.

Three occasions: every ``every`` steps (the cadence), once when the stream or the step limit ends
training (the final snapshot), and once when an interrupt stops it. What constrains them is the
data cursor a snapshot carries: with N producer ranks feeding each drafter replica (an N -> M
fan-in) one cursor fits every producer only after a step where each has sent as many rows, so the
cadence must fall on such steps and an interrupt waits for the next one. With ``steps_per_row``
the trainer takes several steps on each row: a cursor then fits only between rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_core.facts import snapshot_cadence


@dataclass(frozen=True)
class SnapshotPolicy:
    every: int
    """Steps between snapshots; 0: only at the end."""
    fan_in: int = 1
    """Producer ranks feeding each replica."""
    rows_per_step: int = 1
    steps_per_row: int = 1
    """Steps the trainer takes on each row (then ``rows_per_step`` is 1)."""

    def __post_init__(self) -> None:
        k = self.steps_per_row
        if k > 1 and self.every % k:
            raise ValueError(f"the trainer takes {k} steps on each row (steps_per_row): checkpoints must "
                             f"fall between rows, so every_steps ({self.every}) must be a multiple of {k}")
        if self.fan_in > 1 and self.every and (self.every // k * self.rows_per_step) % self.fan_in:
            rows = (f"every_steps / steps_per_row ({self.every} / {k})" if k > 1 else
                    f"every_steps x rows_per_step ({self.every} x {self.rows_per_step})")
            raise ValueError(
                f"{self.fan_in} producer ranks feed each drafter replica: checkpoints must fall where "
                f"each has sent as many rows, so {rows} must be a multiple of {self.fan_in}")

    @classmethod
    def for_trainer(cls, checkpoint_every: int, consumer_facts: Mapping[str, Mapping[str, Any]],
                    fan_in: int, rows_per_step: int, steps_per_row: int = 1) -> SnapshotPolicy:
        """The trainer's policy: its own ``checkpoint_every``, else the cadence its consumers ask
        for. A cadence the user set is kept exactly (one the trainer cannot save at raises); the
        default one moves up to the nearest step between rows where every producer has sent as
        many rows."""
        every, exact = (checkpoint_every, True) if checkpoint_every else snapshot_cadence(consumer_facts)
        if not exact:
            unit = steps_per_row * fan_in // math.gcd(fan_in, rows_per_step)
            every = -(-every // unit) * unit
        return cls(every, fan_in, rows_per_step, steps_per_row)

    def due(self, step: int) -> bool:
        """A snapshot after this step, by the cadence?"""
        return bool(self.every) and step % self.every == 0

    def boundary(self, step: int) -> bool:
        """After ``step`` whole steps, is the trainer between rows, and has every producer rank
        sent as many rows (one data cursor fits them all, so the run may be snapshotted or
        stopped here)?"""
        rows, within = divmod(step, self.steps_per_row)
        return within == 0 and rows * self.rows_per_step % self.fan_in == 0
