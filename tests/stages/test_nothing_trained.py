"""A run that trains nothing fails (exit 1) and says why, instead of ending "done" with 0 steps:
a tokenize stage that keeps no record, and a train stage that no row reaches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.stages.online_fixtures import TINY_TRAIN, online_pipeline

PLUGIN = "tests.stages.online_fixtures"


def test_tokenize_keeping_no_record_fails_with_reasons(tmp_path: Path, cli: Any,
                                                       qwen3_dir: str) -> None:
    data = tmp_path / "data" / "chats.jsonl"
    data.parent.mkdir()
    records = [{"note": "no conversation here"}] * 3 + ["not json"]
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"""version: 1
run_dir: {tmp_path / 'run'}
stages:
  download: {{uses: fsspec, params: {{source: "{data.parent}/*.jsonl"}}}}
  tokenize: {{uses: chat_template, after: download, params: {{tokenizer: "{qwen3_dir}", workers: 0}}}}
""")
    res = cli("run", pipe)
    assert res.code == 1, res.text
    quarantine = next((tmp_path / "run" / "artifacts" / "tokenize").glob("*/quarantine.jsonl"))
    assert len(quarantine.read_text().splitlines()) == 4
    [line] = res.lines_with("error: stage 'tokenize' failed")
    assert ("none of the 4 records became a sample (4 quarantined, 0 filtered); "
            f"top reasons: unknown_format 3, invalid_json 1; quarantined records with their "
            f"reasons: {quarantine}") in line


def test_train_reached_by_no_row_fails(tmp_path: Path, cli: Any, target: Path) -> None:
    pipe = tmp_path / "p.yaml"
    pipe.write_text(online_pipeline(tmp_path / "run", target, pack=dict(rows=0),
                                    train=TINY_TRAIN, checkpoint=dict(every_steps=100)))
    res = cli("run", "-p", PLUGIN, pipe)
    assert res.code == 1, res.text
    [line] = res.lines_with("error: stage 'train' failed")
    assert "no feature rows reached it, so no optimizer step was taken" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
