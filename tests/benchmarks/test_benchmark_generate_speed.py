"""benchmarks/generate_speed.py on the CPU: SmolLM2 on real prompts, with a cache budget and the profile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_rows_in_flight_are_timed_and_the_decode_is_profiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """One row of the table per rows-in-flight setting, each run's outputs compared with the first's
    (fp32 on the CPU: equal), and ``--profile`` writes the operator table of one call."""
    monkeypatch.syspath_prepend(str(BENCH))
    import generate_speed

    profile = tmp_path / "profile.txt"
    monkeypatch.setattr(sys, "argv", ["generate_speed.py", "--model", "smollm2", "--device", "cpu",
                                      "--num-prompts", "4", "--max-new-tokens", "4", "--max-prompt-tokens", "64",
                                      "--batch-size", "2", "--batch-size", "4", "--mode", "in-flight",
                                      "--max-batch-tokens", "200", "--profile", str(profile), "--profile-steps", "2"])
    generate_speed.main()
    out = capsys.readouterr().out
    assert "max_batch_tokens 200" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("sdpa_grouped ") and ln.split()[1].isdigit()]
    assert [r[1] for r in rows] == ["2", "4"] and rows[1][-1] == "4/4"  # the same outputs as the first run
    text = profile.read_text()
    assert text.startswith("2 prompts, 2 decode steps") and "aten::" in text
