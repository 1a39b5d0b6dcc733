"""The GPU's clock and power while a benchmark runs, sampled by ``nvidia-smi`` in the background.

Why: the H200 runs the drafter step at its 700 W power limit and lowers its clock to stay there
(docs/benchmarks.md, session 9), to a clock that differs from chip to chip. A step time means
little without the clock it ran at, so ``train_step.py`` prints both.

    with ClockLog(device) as clocks:
        ...                                   # the timed work
    print(describe(clocks.summary))
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable
from typing import Any

import torch

from dflash_core.devices import torch_device

FIELDS = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # the clock reason bit "held down to stay within the power limit"


class ClockLog:
    """``nvidia-smi`` sampling ``device`` every ``interval_ms`` for the duration of the ``with``;
    ``summary`` (``summarize``) afterwards, None where there is no nvidia-smi or no sample."""

    def __init__(self, device: torch.device, interval_ms: int = 200) -> None:
        self.device, self.interval_ms = device, interval_ms
        self.summary: dict[str, Any] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None

    def __enter__(self) -> ClockLog:
        exe = shutil.which("nvidia-smi")
        if exe is None or self.device.type != "cuda":
            return self
        # by UUID: torch's device index need not be nvidia-smi's (CUDA_VISIBLE_DEVICES)
        uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
        if uuid is None:
            gpu = str(torch_device(self.device).index)
        else:
            gpu = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
        # into a file, stopped by SIGTERM: how it was run beside the session-9 benchmarks
        self._out = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [exe, f"--id={gpu}", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
             "-lms", str(self.interval_ms)], stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._out.seek(0)
        self.summary = summarize(self._out.read().splitlines())
        self._out.close()


def summarize(lines: Iterable[str]) -> dict[str, Any] | None:
    """Median / range of the SM clock and power over the samples where the GPU was working (power
    above half its limit: the idle moments of a benchmark would pull the medians down), and the
    share of those held down by the power limit. ``lines``: ``FIELDS`` as nvidia-smi's csv without
    header or units ("1530, 689.64, 700.00, 0x0000000000000004")."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except (IndexError, ValueError):  # "[N/A]", a cut-off last line
            continue
    busy = [r for r in rows if r[1] > 0.5 * r[2]]
    if not busy:
        return None
    clocks = [r[0] for r in busy]
    return {"samples": len(busy), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "sm_mhz_max": max(clocks), "power_w_median": statistics.median(r[1] for r in busy),
            "power_limit_w": busy[0][2],
            "power_capped_share": sum(1 for r in busy if r[3] & SW_POWER_CAP) / len(busy)}


def describe(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "GPU clock: no samples (no nvidia-smi, or the GPU never worked above half its power limit)"
    return (f"GPU clock over {summary['samples']} samples: SM {summary['sm_mhz_median']:.0f} MHz median "
            f"({summary['sm_mhz_min']:.0f}-{summary['sm_mhz_max']:.0f}), power {summary['power_w_median']:.0f} W "
            f"median of a {summary['power_limit_w']:.0f} W limit, held down by it in "
            f"{summary['power_capped_share']:.0%} of the samples")
