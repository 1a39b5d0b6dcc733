"""tokenize:chat_template on a corpus of bad records: each one quarantined with its reason, the good
records of the same files kept, and records in = samples out + filtered + quarantined."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_stages.tokenize.output import check_invariant
from tests.stages.test_tokenize import run_stage

DATA = Path(__file__).parent / "data" / "bad_records"

MIXED = {  # line -> reason (see the fixture); lines 1, 9, 20 are good, 8 and 18 blank
    2: "invalid_json", 3: "bad_messages", 4: "not_an_object", 5: "no_assistant_turn",
    6: "empty_assistant_turn", 7: "unknown_role", 10: "bad_content", 11: "missing_completion",
    12: "unknown_format", 13: "unclosed_think", 14: "special_token_in_content",
    15: "bad_reasoning", 16: "bad_tool_calls", 17: "bad_message", 19: "invalid_utf8",
}


def _item(path: Path) -> dict:
    return {"path": str(path), "source": path.name, "size": path.stat().st_size, "etag": ""}


def test_bad_records_corpus(tmp_path: Path, qwen3_dir: str) -> None:  # noqa: F811
    files = [DATA / n for n in ("mixed.jsonl", "invalid_utf8.jsonl", "bom.jsonl", "empty.jsonl")]
    big = tmp_path / "huge.jsonl"   # a valid record on a 10 MB line between two good ones
    good = json.dumps({"prompt": "Big?", "completion": "No."})
    big.write_text(good + "\n" + json.dumps({"prompt": "x" * (10 << 20), "completion": "y"})
                   + "\n" + good + "\n")
    items = [_item(p) for p in files] + [_item(big)]

    _, ctx, rows = run_stage(tmp_path, items, tokenizer=qwen3_dir)
    s = ctx.summary
    kept = sorted((r["source"], r["line"]) for r in rows)
    assert kept == [("bom.jsonl", 1), ("bom.jsonl", 2), ("huge.jsonl", 1), ("huge.jsonl", 3),
                    ("invalid_utf8.jsonl", 1), ("invalid_utf8.jsonl", 3),
                    ("mixed.jsonl", 1), ("mixed.jsonl", 9), ("mixed.jsonl", 20)]
    q = [json.loads(x) for x in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    got = {(e["file"], e["line"]): e["reason"] for e in q}
    want = {("mixed.jsonl", n): r for n, r in MIXED.items()}
    want[("invalid_utf8.jsonl", 2)] = "invalid_utf8"
    want[("huge.jsonl", 2)] = "record_too_large"
    assert got == want
    assert all(e["detail"] and len(e["excerpt"]) <= 201 for e in q)
    assert next(e for e in q if e["reason"] == "record_too_large")["excerpt"].startswith('{"prompt": "xxx')
    assert "\ufffd" in next(e for e in q if e["file"] == "invalid_utf8.jsonl")["excerpt"]

    assert s["records_in"] == 9 + 15 + 1 + 1 == 26
    assert (s["samples_out"], s["filtered_total"], s["quarantined_total"]) == (9, 0, 17)
    assert s["quarantined"]["invalid_utf8"] == 2 and s["quarantined"]["record_too_large"] == 1
    assert s["blank_lines"] == 2 and s["bom_stripped"] == 1 and s["files"] == 5
    # the BOM line is the same sample as without the BOM
    bom = [r for r in rows if r["source"] == "bom.jsonl"]
    assert bom[0]["input_ids"][:3] == bom[1]["input_ids"][:3]


def test_template_error_is_quarantined(tmp_path: Path, qwen3_dir: str) -> None:  # noqa: F811
    strict = ("{%- for m in messages %}{%- if m.role == 'system' %}"
              "{{ raise_exception('no system messages') }}{%- endif %}"
              "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"system": "s", "prompt": "p", "completion": "c"}) + "\n"
                   + json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    _, ctx, rows = run_stage(tmp_path, [_item(src)], tokenizer=qwen3_dir,
                             chat_template_kwargs={"chat_template": strict})
    assert [r["line"] for r in rows] == [2]
    assert ctx.summary["quarantined"] == {"template_error": 1}
    q = json.loads((tmp_path / "out" / "quarantine.jsonl").read_text())
    assert "no system messages" in q["detail"]


def test_only_bad_and_empty_inputs(tmp_path: Path, qwen3_dir: str) -> None:  # noqa: F811
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(DATA / "empty.jsonl", d / "empty.jsonl")
    (d / "bad.jsonl").write_text("nope\n\n[]\n")
    with pytest.raises(ValueError, match="none of the 2 records became a sample"):
        run_stage(tmp_path, [_item(d / "empty.jsonl"), _item(d / "bad.jsonl")], tokenizer=qwen3_dir)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())  # written for the user to read
    assert (stats["records_in"], stats["quarantined_total"]) == (2, 2)
    with pytest.raises(ValueError, match=r"the 1 input file\(s\) hold no records"):
        run_stage(tmp_path, [_item(d / "empty.jsonl")], "empty", tokenizer=qwen3_dir)


def test_invariant_violation_raises() -> None:
    stats = {"records_in": 3, "samples_out": 1, "filtered_total": 1, "quarantined_total": 0}
    with pytest.raises(RuntimeError, match="records in"):
        check_invariant(stats)
    check_invariant({**stats, "quarantined_total": 1})


def test_sharegpt_conversations_are_the_same_sample_as_messages(tmp_path: Path, qwen3_dir: str) -> None:
    """ShareGPT records (``conversations`` of ``{from, value}``, human/gpt/system) tokenize to exactly
    the sample of the equivalent ``messages`` record; an unknown ``from`` is quarantined."""
    turns = [("system", "Be brief."), ("human", "Hi?"), ("gpt", "Hello."), ("human", "2+2?"), ("gpt", "4.")]
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    sharegpt = {"id": "x_0", "conversations": [{"from": f, "value": v} for f, v in turns]}
    messages = {"messages": [{"role": role[f], "content": v} for f, v in turns]}
    bad = {"conversations": [{"from": "bard", "value": "?"}, {"from": "gpt", "value": "!"}]}
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (sharegpt, messages, bad)))
    _, ctx, rows = run_stage(tmp_path, [_item(path)], tokenizer=qwen3_dir)
    assert len(rows) == 2
    assert rows[0]["input_ids"] == rows[1]["input_ids"] and rows[0]["loss_mask"] == rows[1]["loss_mask"]
    assert sum(rows[0]["loss_mask"]) > 0
    assert ctx.summary["quarantined"] == {"unknown_role": 1}
