"""benchmarks/hybrid_forward.py on the CPU: the tiny hybrid shape, FP8 layers, and its profile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_fp8_forward_is_timed_and_profiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile DIR`` writes a table per row length of what the forward ran (on the CPU, its
    host operators), beside the isolation and speed table."""
    monkeypatch.syspath_prepend(str(BENCH))
    import hybrid_forward

    monkeypatch.setattr(sys, "argv", ["hybrid_forward.py", "--device", "cpu", "--tiny", "--fp8", "--tokens", "64",
                                      "--warmup", "0", "--reps", "1", "--profile", str(tmp_path)])
    assert hybrid_forward.main() == 0
    table = capsys.readouterr().out
    assert "| 64 | linear_attention |" in table and "| 64 | full_attention |" in table
    profile = (tmp_path / "profile-64-fp8.txt").read_text()
    assert profile.startswith("profile of 2 steps") and "host: operators by own CPU time" in profile
    assert "aten::" in profile and (tmp_path / "profile-64-fp8.trace.json.gz").stat().st_size > 0
