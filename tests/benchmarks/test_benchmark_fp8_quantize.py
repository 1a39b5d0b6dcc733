"""benchmarks/fp8_quantize.py: its byte count, its comparison and table on the CPU (the benchmark
itself needs a GPU and says so without one); on a GPU, a small run end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_quantize  # noqa: E402  (a script directory, not a package)

from dflash_model.target import fp8  # noqa: E402


def run(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["fp8_quantize.py", *args])
    return fp8_quantize.main()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_without_cuda_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(monkeypatch) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bytes_differences_and_table() -> None:
    """The ideal counts x once, a byte per element of q and 4 per scale; a differing byte, scale
    or layout is counted; the table has a line per version and width."""
    assert fp8_quantize.traffic(16384, 5120, 2) == 16384 * 5120 * 3 + 16384 * 40 * 4
    want = fp8._quantize_columns(torch.randn(6, 256))
    assert fp8_quantize.differences(want, want) == {"q_bytes": 0, "scales": 0, "same_strides": True}
    q, s = want[0].clone(), want[1].contiguous()  # (the scales row-major: another layout)
    q.view(torch.uint8)[2, 7] ^= 1
    s[1, 1] *= 2
    got = fp8_quantize.differences((q, s), want)
    assert got == {"q_bytes": 1, "scales": 1, "same_strides": False}
    assert not fp8_quantize.equal(got) and fp8_quantize.equal(fp8_quantize.differences(want, want))
    same = fp8_quantize.differences(want, want)
    result = {"M": 16384, "K": 5120, "dtype": "bfloat16", "bytes": 254_279_680, "ideal_ms": 254_279_680 / 4.8e9,
              "compiled": {"ms": 0.578, "first_call_s": 9.1, "vs_eager": got},
              "triton": [{"rows": 16, "ms": 0.089, "first_call_s": 0.4, "vs_eager": same, "vs_compiled": got}]}
    lines = fp8_quantize.table([result], 4.8).splitlines()
    assert len(lines) == 5 and lines[0].startswith("| M x K (bfloat16) | version | ms | TB/s | x ideal (4.8 TB/s)")
    assert lines[2] == ("| 16,384 x 5,120 | compiled | 0.578 | 0.44 | 10.9 | 9.1 "
                        "| 1 q bytes, 1 scales, other strides | |")
    assert lines[3] == ("| 16,384 x 5,120 | triton 16 rows | 0.089 | 2.86 | 1.7 | 0.4 | equal "
                        "| 1 q bytes, 1 scales, other strides |")
    assert lines[4] == "| 16,384 x 5,120 | memory-bound ideal | 0.053 | 4.8 | 1.0 | | | |"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the benchmark runs on CUDA")
def test_a_small_run_on_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert run(monkeypatch, "--m", "100", "--k", "256,384", "--rows", "16,32", "--warmup", "1", "--reps", "2",
               "--json", str(out)) == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["M"], r["K"]) for r in res] == [(100, 256), (100, 384)]
    assert all(fp8_quantize.equal(t["vs_eager"]) for r in res for t in r["triton"])
