"""benchmarks/quality_sweep.py: a data-size point takes the first records in prompt-file order."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.quality_sweep import write_records


def test_a_fraction_of_the_records_follows_the_prompt_files_not_the_shards(tmp_path: Path) -> None:
    # generate's shards are sorted by prompt length: shard 0 holds the longest prompts
    shards = [[("b.jsonl", 2), ("a.jsonl", 9)], [("a.jsonl", 1), ("b.jsonl", 1), ("a.jsonl", 10)]]
    paths = []
    for k, shard in enumerate(shards):
        path = tmp_path / f"shard-{k:05d}.jsonl"
        # as generate writes them (ensure_ascii=False): a text may hold U+2028, which is no line end
        path.write_text("".join(json.dumps({"source": s, "line": n, "text": f"{n}\u2028next"}, ensure_ascii=False)
                                + "\n" for s, n in shard), encoding="utf-8")
        paths.append(str(path))
    out = tmp_path / "records.jsonl"
    assert write_records(paths, 0.6, out) == 3
    kept = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x]
    assert [(r["source"], r["line"], r["text"]) for r in kept] == [
        ("a.jsonl", 1, "1\u2028next"), ("a.jsonl", 9, "9\u2028next"), ("a.jsonl", 10, "10\u2028next")]
