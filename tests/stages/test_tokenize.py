"""tokenize:chat_template with the real Qwen3 tokenizer: golden masks checked token by token,
agreement with transformers' generation-tag masks, policies, stats and worker determinism."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_core.stage import StageContext
from dflash_stages.tokenize.stage import ChatTemplateTokenize, TokenizeConfig, stats_table

THINK, END_THINK, IM_END = 151667, 151668, 151645


def write_jsonl(path: Path, records: list[Any]) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return {"path": str(path), "source": f"file://{path}", "size": path.stat().st_size, "etag": "x"}


def run_stage(tmp_path: Path, items: list[dict], name: str = "out", **params: Any
              ) -> tuple[list[dict], StageContext, list[dict]]:
    """Run the stage; returns (output items, ctx, rows of all shards in order)."""
    import pyarrow.ipc as ipc

    params.setdefault("workers", 0)
    cfg = TokenizeConfig(**params)
    ctx = StageContext(stage="tokenize", config=cfg, work_dir=str(tmp_path / name))
    out = list(ChatTemplateTokenize(cfg).run({"files": iter(items)}, ctx))
    rows: list[dict] = []
    for item in out:
        rows.extend(ipc.open_file(item["shard"]).read_all().to_pylist())
    return out, ctx, rows


def one(tmp_path: Path, qwen3_dir: str, record: Any, **params: Any) -> dict:
    _, ctx, rows = run_stage(tmp_path, [write_jsonl(tmp_path / "in.jsonl", [record])],
                             tokenizer=qwen3_dir, **params)
    assert len(rows) == 1, ctx.summary
    return rows[0]


def pairs(tok: Any, row: dict) -> list[tuple[str, int]]:
    return [(tok.decode([i]), m) for i, m in zip(row["input_ids"], row["loss_mask"])]


PROMPT_2P2 = [("<|im_start|>", 0), ("user", 0), ("\n", 0), ("What", 0), (" is", 0), (" ", 0),
              ("2", 0), ("+", 0), ("2", 0), ("?", 0), ("<|im_end|>", 0), ("\n", 0),
              ("<|im_start|>", 0), ("assistant", 0), ("\n", 0)]
R_2P2 = {"messages": [{"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]}


def test_single_turn_thinking_on(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    row = one(tmp_path, qwen3_dir, R_2P2, thinking=True)
    # the model generates <think> … </think>, the answer and <|im_end|>; the newline after
    # <|im_end|> is template formatting (generation stopped at <|im_end|>)
    assert pairs(qwen3, row) == PROMPT_2P2 + [
        ("<think>", 1), ("\n", 1), ("Add", 1), (" them", 1), (".\n", 1), ("</think>", 1),
        ("\n\n", 1), ("4", 1), ("<|im_end|>", 1), ("\n", 0)]
    ids = row["input_ids"]
    assert ids[15] == THINK and ids[20] == END_THINK and ids[23] == IM_END
    assert row["source"].endswith("in.jsonl") and row["line"] == 1


def test_single_turn_thinking_off(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    row = one(tmp_path, qwen3_dir, R_2P2, thinking=False)
    # served with enable_thinking=False, the prompt already ends in the empty think block:
    # reasoning dropped, the block is prompt (unsupervised), answer + <|im_end|> supervised
    assert pairs(qwen3, row) == PROMPT_2P2 + [
        ("<think>", 0), ("\n\n", 0), ("</think>", 0), ("\n\n", 0), ("4", 1), ("<|im_end|>", 1),
        ("\n", 0)]
    assert row["input_ids"][15] == THINK and row["input_ids"][17] == END_THINK


def test_inline_think_equals_reasoning_field(tmp_path: Path, qwen3_dir: str) -> None:
    inline = {"messages": [{"role": "user", "content": "What is 2+2?"},
                           {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}]}
    for thinking in (True, False):
        a = one(tmp_path / f"a{thinking}", qwen3_dir, R_2P2, thinking=thinking)
        b = one(tmp_path / f"b{thinking}", qwen3_dir, inline, thinking=thinking)
        assert (a["input_ids"], a["loss_mask"]) == (b["input_ids"], b["loss_mask"])


def test_system_prompt_prompt_completion_format(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    rec = {"system": "Be brief.", "prompt": "Hi", "completion": "Hello!", "reasoning": "Greet back."}
    row = one(tmp_path, qwen3_dir, rec)
    assert pairs(qwen3, row) == [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("Be", 0), (" brief", 0), (".", 0),
        ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hi", 0),
        ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0), ("assistant", 0), ("\n", 0),
        ("<think>", 1), ("\n", 1), ("G", 1), ("reet", 1), (" back", 1), (".\n", 1),
        ("</think>", 1), ("\n\n", 1), ("Hello", 1), ("!", 1), ("<|im_end|>", 1), ("\n", 0)]


MULTI = {"messages": [
    {"role": "user", "content": "A?"}, {"role": "assistant", "content": "B.", "reasoning_content": "r1"},
    {"role": "user", "content": "C?"}, {"role": "assistant", "content": "D.", "reasoning_content": "r2"}]}
MULTI_HEAD = [("<|im_start|>", 0), ("user", 0), ("\n", 0), ("A", 0), ("?", 0), ("<|im_end|>", 0),
              ("\n", 0), ("<|im_start|>", 0), ("assistant", 0), ("\n", 0),
              # Qwen3 drops r1 from the earlier turn: it is masked as the template renders it
              ("B", 1), (".", 1), ("<|im_end|>", 1), ("\n", 0),
              ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("C", 0), ("?", 0), ("<|im_end|>", 0),
              ("\n", 0), ("<|im_start|>", 0), ("assistant", 0), ("\n", 0)]


def test_multi_turn_earlier_reasoning_dropped(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    row = one(tmp_path / "on", qwen3_dir, MULTI, thinking=True)
    assert pairs(qwen3, row) == MULTI_HEAD + [
        ("<think>", 1), ("\n", 1), ("r", 1), ("2", 1), ("\n", 1), ("</think>", 1), ("\n\n", 1),
        ("D", 1), (".", 1), ("<|im_end|>", 1), ("\n", 0)]
    row = one(tmp_path / "off", qwen3_dir, MULTI, thinking=False)
    assert pairs(qwen3, row) == MULTI_HEAD + [
        ("<think>", 0), ("\n\n", 0), ("</think>", 0), ("\n\n", 0), ("D", 1), (".", 1),
        ("<|im_end|>", 1), ("\n", 0)]


def test_tool_messages(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    rec = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.",
         "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Rain"},
        {"role": "assistant", "content": "Rainy.", "reasoning_content": "Report."}]}
    row = one(tmp_path, qwen3_dir, rec)
    assert pairs(qwen3, row) == [
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Weather", 0), ("?", 0), ("<|im_end|>", 0),
        ("\n", 0), ("<|im_start|>", 0), ("assistant", 0), ("\n", 0),
        ("<think>", 1), ("\n", 1), ("Call", 1), (" it", 1), (".\n", 1), ("</think>", 1),
        ("\n\n", 1), ("<tool_call>", 1), ("\n", 1), ('{"', 1), ("name", 1), ('":', 1), (' "', 1),
        ("get", 1), ('",', 1), (' "', 1), ("arguments", 1), ('":', 1), (' {"', 1), ("city", 1),
        ('":', 1), (' "', 1), ("Os", 1), ("lo", 1), ('"}}\n', 1), ("</tool_call>", 1),
        ("<|im_end|>", 1), ("\n", 0),
        # the tool result is input, not generated
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("<tool_response>", 0), ("\n", 0),
        ("Rain", 0), ("\n", 0), ("</tool_response>", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("assistant", 0), ("\n", 0),
        ("<think>", 1), ("\n", 1), ("Report", 1), (".\n", 1), ("</think>", 1), ("\n\n", 1),
        ("Rain", 1), ("y", 1), (".", 1), ("<|im_end|>", 1), ("\n", 0)]


def supervised_spans(tok: Any, row: dict) -> list[str]:
    spans, cur = [], []
    for i, m in zip(row["input_ids"] + [0], row["loss_mask"] + [0]):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


def test_tool_chain_then_new_user_turn(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    # a new user message makes Qwen3 re-render the earlier tool-call turns without reasoning, so
    # their generation prompt in context differs from the final rendering (found by its header)
    rec = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.",
         "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Rain"},
        {"role": "assistant", "content": "Rainy.", "reasoning_content": "Report."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Welcome.", "reasoning_content": "Polite."}]}
    call = '<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    for thinking, last in ((True, "<think>\nPolite.\n</think>\n\nWelcome.<|im_end|>"),
                           (False, "Welcome.<|im_end|>")):
        _, ctx, rows = run_stage(tmp_path, [write_jsonl(tmp_path / "in.jsonl", [rec])],
                                 f"t{thinking}", tokenizer=qwen3_dir, thinking=thinking)
        assert supervised_spans(qwen3, rows[0]) == [call, "Rainy.<|im_end|>", last]
        assert ctx.summary["rewritten_turns"] >= 1


def test_ids_equal_apply_chat_template(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    recs = [R_2P2, MULTI, {"messages": [{"role": "user", "content": "Ünïcödé — 中文 🙂 e\u0301?"},
                                        {"role": "assistant", "content": "Ja, ½ · π ≈ 3.14…",
                                         "reasoning_content": "Ströme\u00a0und  Leer\tzeichen\r\n"}]}]
    _, _, rows = run_stage(tmp_path, [write_jsonl(tmp_path / "in.jsonl", recs)], tokenizer=qwen3_dir)
    for rec, row in zip(recs, rows):
        enc = qwen3.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, enable_thinking=True)
        assert row["input_ids"] == list(enc["input_ids"])


GEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_agrees_with_generation_tags(tmp_path: Path, qwen3_dir: str, qwen3: Any) -> None:
    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A?"},
         {"role": "assistant", "content": "B."}, {"role": "user", "content": "C?"},
         {"role": "assistant", "content": "D, then E.\n\nDone."}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "x"},
         {"role": "tool", "content": "result"}, {"role": "assistant", "content": "  spaced  "}],
    ]
    reasoned = {"messages": [{"role": "user", "content": "Why?"},
                             {"role": "assistant", "content": "Because.", "reasoning_content": "Hmm."}]}
    items = [write_jsonl(tmp_path / "in.jsonl", [{"messages": c} for c in convs] + [reasoned])]
    _, ctx, rows = run_stage(tmp_path, items, tokenizer=qwen3_dir,
                             chat_template_kwargs={"chat_template": GEN_TEMPLATE})
    assert len(rows) == 4, ctx.summary
    # a template without reasoning_content support gets the reasoning inline
    convs.append([reasoned["messages"][0],
                  {"role": "assistant", "content": "<think>\nHmm.\n</think>\n\nBecause."}])
    for conv, row in zip(convs, rows):
        ref = qwen3.apply_chat_template(conv, chat_template=GEN_TEMPLATE, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
        assert row["input_ids"] == list(ref["input_ids"])
        assert row["loss_mask"] == list(ref["assistant_masks"])
        assert sum(row["loss_mask"]) > 0


def test_max_len_policies_and_min_loss_tokens(tmp_path: Path, qwen3_dir: str) -> None:
    long = {"prompt": "Tell me.", "completion": " ".join(["word"] * 60)}
    short = {"prompt": "Yes or no?", "completion": "Yes."}
    items = [write_jsonl(tmp_path / "in.jsonl", [long, short, R_2P2])]

    _, ctx, rows = run_stage(tmp_path, items, "drop", tokenizer=qwen3_dir, max_len=40)
    assert [r["line"] for r in rows] == [2, 3]
    assert ctx.summary["filtered"] == {"too_long": 1}

    _, ctx, rows = run_stage(tmp_path, items, "trunc", tokenizer=qwen3_dir, max_len=40,
                             overflow="truncate")
    assert [len(r["input_ids"]) for r in rows][0] == 40 and len(rows) == 3
    assert ctx.summary["truncated"] == 1 and ctx.summary["filtered_total"] == 0

    # "Yes." + <|im_end|> under thinking off = 3 supervised tokens (Yes . <|im_end|>)
    _, ctx, rows = run_stage(tmp_path, items, "min", tokenizer=qwen3_dir, thinking=False,
                             min_loss_tokens=4)
    assert [r["line"] for r in rows] == [1]
    assert ctx.summary["filtered"] == {"min_loss_tokens": 2}
    hist = ctx.summary["loss_tokens_hist"]
    assert hist["1-7"] == 2 and hist["32-127"] == 1 and sum(hist.values()) == 3


def test_outputs_stats_and_table(tmp_path: Path, qwen3_dir: str) -> None:
    from rich.table import Table

    items = [write_jsonl(tmp_path / "b.jsonl", [R_2P2] * 3),
             write_jsonl(tmp_path / "a.jsonl", [MULTI, "not json", "", R_2P2])]
    out, ctx, rows = run_stage(tmp_path, items, tokenizer=qwen3_dir, shard_samples=2)
    assert [o["samples"] for o in out] == [2, 2, 1] and [o["index"] for o in out] == [0, 1, 2]
    assert sum(o["tokens"] for o in out) == sum(len(r["input_ids"]) for r in rows)
    assert sum(o["loss_tokens"] for o in out) == sum(sum(r["loss_mask"]) for r in rows)
    # input files are taken sorted by source: a.jsonl first
    assert [(Path(r["source"]).name, r["line"]) for r in rows] == [
        ("a.jsonl", 1), ("a.jsonl", 4), ("b.jsonl", 1), ("b.jsonl", 2), ("b.jsonl", 3)]
    s = ctx.summary
    assert (s["records_in"], s["samples_out"], s["quarantined_total"], s["blank_lines"]) == (6, 5, 1, 1)
    assert s["assistant_turns"] == 6 and s["files"] == 2 and s["shards"] == 3
    work = tmp_path / "out"
    assert json.loads((work / "stats.json").read_text()) == json.loads(json.dumps(s))
    q = [json.loads(x) for x in (work / "quarantine.jsonl").read_text().splitlines()]
    assert q == [{"file": items[1]["source"], "line": 2, "reason": "invalid_json",
                  "detail": q[0]["detail"], "excerpt": "not json"}]
    assert isinstance(stats_table(s), Table)


def test_workers_spawn_byte_identical(tmp_path: Path, qwen3_dir: str) -> None:
    recs = [{"messages": [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 7)},
                          {"role": "assistant", "content": f"Answer {i}." + " more" * (i % 11),
                           "reasoning_content": "Because " * (i % 5)}]} for i in range(90)]
    recs[17] = "{broken"
    items = [write_jsonl(tmp_path / "x.jsonl", recs[:50]), write_jsonl(tmp_path / "y.jsonl", recs[50:])]
    a, sa, _ = run_stage(tmp_path, items, "w0", tokenizer=qwen3_dir, workers=0, batch_size=7,
                         shard_samples=20)
    b, sb, _ = run_stage(tmp_path, items, "w2", tokenizer=qwen3_dir, workers=2, batch_size=7,
                         shard_samples=20)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert Path(x["shard"]).read_bytes() == Path(y["shard"]).read_bytes()
    for name in ("quarantine.jsonl", "stats.json"):
        assert (tmp_path / "w0" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert sa.summary == sb.summary and sa.summary["samples_out"] == 89


def test_config_checks() -> None:
    with pytest.raises(ValueError):
        TokenizeConfig(tokenizer="x", overflow="wrap")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TokenizeConfig(tokenizer="x", chat_template_kwargs={"enable_thinking": False})
    assert ChatTemplateTokenize.cache_ignore == ("workers", "batch_size")
    assert (ChatTemplateTokenize.kind, ChatTemplateTokenize.name) == ("tokenize", "chat_template")
