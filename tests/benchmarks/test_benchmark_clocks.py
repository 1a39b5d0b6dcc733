"""benchmarks/gpu_clocks.py: reading nvidia-smi's samples into the clock a benchmark ran at.
The lines are in the form nvidia-smi printed them on the H200 (session 9)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_clocks import ClockLog, describe, summarize  # noqa: E402  (a script directory, not a package)

IDLE = "345, 83.43, 700.00, 0x0000000000000001"  # GPU idle
CAPPED = ["1530, 689.64, 700.00, 0x0000000000000004", "1455, 700.00, 700.00, 0x0000000000000004",
          "1590, 683.10, 700.00, 0x0000000000000004"]
FREE = "1980, 402.50, 700.00, 0x0000000000000000"  # working, under the limit


def test_summary_of_the_working_samples():
    lines = [IDLE, *CAPPED, IDLE, FREE, "[N/A], [N/A], 700.00, [N/A]", "1530, 68"]  # last: cut off
    s = summarize(lines)
    assert s == {"samples": 4, "sm_mhz_median": 1560.0, "sm_mhz_min": 1455.0, "sm_mhz_max": 1980.0,
                 "power_w_median": pytest.approx((683.10 + 689.64) / 2), "power_limit_w": 700.0,
                 "power_capped_share": 0.75}
    assert describe(s) == ("GPU clock over 4 samples: SM 1560 MHz median (1455-1980), power 686 W median of a "
                           "700 W limit, held down by it in 75% of the samples")


def test_no_working_sample_is_no_summary():
    assert summarize([IDLE, IDLE, ""]) is None
    assert describe(None).startswith("GPU clock: no samples")


def test_no_samples_off_cuda():
    with ClockLog(torch.device("cpu")) as clocks:
        pass
    assert clocks.summary is None
