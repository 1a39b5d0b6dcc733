"""download -> tokenize through the CLI on a moto S3 server: ``--only tokenize`` from the stored
download artifact, and a changed object making tokenize stale in ``status``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORD = {"messages": [{"role": "user", "content": "Say hi."},
                       {"role": "assistant", "content": "Hi there, nice to meet you!"}]}


def _pipeline(path: Path, run_dir: Path, endpoint: str, tokenizer: str) -> Path:
    path.write_text(f"""version: 1
run_dir: {run_dir}
stages:
  download:
    uses: fsspec
    params:
      source: "s3://data/chats/*.jsonl"
      storage_options: {{client_kwargs: {{endpoint_url: "{endpoint}"}}}}
  tokenize:
    uses: chat_template
    after: download
    params: {{tokenizer: "{tokenizer}", thinking: false, workers: 0, min_loss_tokens: 1}}
""")
    return path


def _put(fs: Any, key: str, n: int) -> None:
    fs.pipe(f"data/chats/{key}", ("\n".join(json.dumps(RECORD) for _ in range(n)) + "\n").encode())


def _status_line(out: str, stage: str) -> str:
    return next(line for line in out.splitlines() if line.strip().strip("│┃ ").startswith(stage))


def test_only_tokenize_and_stale_after_changed_object(tmp_path: Path, s3_env: Any, cli: Any,
                                                      qwen3_dir: str) -> None:
    fs = s3_env.fs()
    fs.mkdir("data")
    _put(fs, "a.jsonl", 3)
    _put(fs, "b.jsonl", 2)
    pipe = _pipeline(tmp_path / "p.yaml", tmp_path / "run", s3_env.endpoint_url, qwen3_dir)

    first = cli("run", pipe)
    assert first.code == 0, first.err
    again = cli("run", "--only", "tokenize", pipe)  # from the stored download artifact alone
    assert again.code == 0, again.err
    stats = json.loads(next((tmp_path / "run" / "artifacts" / "tokenize").glob("*/stats.json")).read_text())
    assert stats["records_in"] == 5 and stats["samples_out"] == 5

    status = cli("status", pipe)
    assert "fresh" in _status_line(status.out, "tokenize")

    _put(fs, "b.jsonl", 4)  # one object changes on S3
    assert cli("run", "--only", "download", pipe).code == 0
    status = cli("status", pipe)
    line = _status_line(status.out, "tokenize")
    assert "stale" in line and "download" in line, status.out

    assert cli("run", pipe).code == 0
    assert "fresh" in _status_line(cli("status", pipe).out, "tokenize")
