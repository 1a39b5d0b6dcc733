"""benchmarks/fp8_features.py on CPU: a ``-fp8`` preset against its own dequantized weights and its
float twin, every feature layer, and a float target written as an FP8 checkpoint that reads back."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_features  # noqa: E402  (a script directory, not a package)

from dflash_model.target.load import load_target  # noqa: E402


def run(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["fp8_features.py", "--device", "cpu", "--tokens", "64", *args])
    return fp8_features.main()


def test_a_preset_against_the_same_weights_and_its_float_twin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert run(monkeypatch, "--model", "random:tiny-fp8", "--layers", "1,5", "--out", str(out)) == 0
    res = json.loads(out.read_text())
    assert res["tokens"] == 64
    got = {(r["layer"], r["a"], r["b"]): r["rms_rel"] for r in res["results"]}
    assert set(got) == {(t, a, b) for t in (1, 5) for a, b in
                        [("fp8", "same weights"), ("fp8", "unquantized"), ("same weights", "unquantized")]}
    assert all(0 < e < 0.5 for e in got.values())


def test_write_saves_the_float_target_quantized(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--write: the checkpoint holds the weights the run compared (the features read back equal)."""
    out, ckpt = tmp_path / "a.json", tmp_path / "ckpt"
    assert run(monkeypatch, "--model", "random:tiny", "--layers", "3", "--write", str(ckpt), "--out", str(out)) == 0
    again = tmp_path / "b.json"
    assert run(monkeypatch, "--model", str(ckpt), "--layers", "3", "--out", str(again)) == 0
    first, second = (json.loads(p.read_text())["results"] for p in (out, again))
    assert [r for r in first if r["b"] == "same weights"] == second
    assert load_target(str(ckpt), "cpu", "float32", "sdpa")[0].config.num_hidden_layers == 8
