"""``dflash-pipe plan`` measuring on the CPU: the tiny random-init target of online_fixtures and a
pipeline that uses it (pack:synthetic → extract:hf_hooks → train:dflash), through the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.stages.online_fixtures import TINY_TRAIN, online_pipeline

PLUGIN = "tests.stages.online_fixtures"


def test_plan_measures_target_and_drafter_on_cpu(cli, tmp_path: Path, target: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(online_pipeline(tmp_path / "run", target, pack=dict(rows=4, tokens_per_row=96),
                                    train=TINY_TRAIN))
    res = cli("plan", "-p", PLUGIN, path, "--device", "cpu", "--rows", "2", "--gpus", "4")
    assert res.code == 0, res.text
    rates = {}
    for part in ("target forward", "drafter step"):
        m = re.search(rf"{part} +([\d,]+) tokens/s = [\d,.]+ ms per", res.out)
        assert m, res.out
        rates[part] = float(m.group(1).replace(",", ""))
        assert rates[part] > 0
    assert "measured on cpu: 2 rows of 96 tokens each after 1 warm-up" in res.out
    assert "drafter warm-up step" in res.err  # progress of the measurement
    # the table: every layout, rates consistent with the model; memory unknown off CUDA
    base = 1 / (1 / rates["target forward"] + 1 / rates["drafter step"])
    for name in ("one GPU alone", "pairs", "fan-in ", "colocated"):
        assert res.lines_with(f"│ {name}"), res.out
    assert res.lines_with("│ pairs", "target - / drafter -", "?")
    assert "memory unknown (measured off CUDA; give --memory)" in res.out
    assert "recommended: " in res.out
    # 96 tokens x 3 layers x hidden 64 x 2 B (auto = bf16 on GPUs)
    assert "96 tokens × 3 × 64 × 2 B" in res.out
    # the printed rates are rounded to whole tokens/s, so compare within that rounding
    shown = float(res.lines_with("│ one GPU alone")[0].split("│")[3].strip().replace(",", ""))
    assert abs(shown - base) <= 1.0 + 1e-3 * base, (shown, base)

    # --memory and --gpu-memory decide the fit; --json gives the measured figures
    res = cli("plan", "-p", PLUGIN, path, "--device", "cpu", "--rows", "1", "--gpus", "2",
              "--memory", "10,5", "--gpu-memory", "12", "--json")
    assert res.code == 0, res.text
    out = json.loads(res.out)
    m = out["measured"]
    assert m["device"] == "cpu" and m["tokens"] == 96 and m["layers"] == [0, 1, 2]
    assert m["target_tok_s"] > 0 and m["drafter_tok_s"] > 0 and m["target_gib"] is None
    assert m["hidden_size"] == 64 and m["feature_rows"] == 3 and m["compiled"] is False
    plan = out["plan"]
    assert plan["colocated"]["fits"] is False and plan["pairs"]["fits"] is True
    assert plan["recommended"]["name"] in ("pairs", "fan-in 1→1")
