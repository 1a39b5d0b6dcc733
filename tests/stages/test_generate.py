"""generate:hf — prompts in, the target's own completions out, in records tokenize reads back.

SmolLM2-135M-Instruct (the real GGUF target) shows the completions are the target's greedy decode
and that tokenize turns them into exactly those supervised tokens; a tiny random Qwen3 with the real
Qwen3 tokenizer shows skipping, sharding and resume after a crash (sampled, so seeding matters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_core.stage import StageContext
from dflash_model.target import generate as generate_batch
from dflash_stages.generate.stage import GenerateConfig, HFGenerate
from tests.stages.online_fixtures import tiny_target
from tests.transformers_versions import needs_hybrid


def run_generate(tmp_path: Path, files: list[Path], name: str = "gen", events: list[dict] | None = None,
                 **params: Any) -> tuple[list[dict], StageContext, list[dict]]:
    """Run the stage; returns (items, ctx, records of all shards in order); ``events`` collects what
    it emits."""
    cfg = GenerateConfig(**params)
    ctx = StageContext(stage="generate", config=cfg, work_dir=str(tmp_path / name / "work"),
                       cache_dir=str(tmp_path / name / "cache"),
                       emitter=None if events is None else lambda stage, event: events.append(event))
    Path(ctx.work_dir).mkdir(parents=True, exist_ok=True)
    items = list(HFGenerate(cfg).run({"files": iter({"path": str(f), "source": f.name} for f in files)}, ctx))
    records = [json.loads(x) for it in items for x in Path(it["path"]).read_text().splitlines()]
    return items, ctx, records


def write_lines(path: Path, lines: list[Any]) -> Path:
    with open(path, "wb") as f:
        for x in lines:
            f.write(x if isinstance(x, bytes) else json.dumps(x).encode())
            f.write(b"\n")
    return path


def test_completions_are_greedy_decodes_and_tokenize_reads_them_back(tmp_path: Path) -> None:
    """Batched, left-padded generation = the target's one-prompt greedy decode; tokenize's supervised
    tokens of each record are exactly those generated ids (+ the end-of-turn token the template adds
    when the completion was cut); bad prompts are skipped with their reasons, never fatal."""
    from dflash_model.target.smollm2 import load_smollm2
    from dflash_model.target.spec_decode import greedy_decode
    from dflash_stages.generate.prompts import eos_ids, record_messages, render_prompt
    from tests.stages.test_tokenize import run_stage

    good = [{"prompt": "Name a colour."}, {"messages": [{"role": "user", "content": "What is 2+2?"}]},
            {"id": "sg_0", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "x"}]}]
    bad = [b"\xff\xfe not utf-8", b"{not json", {"prompt": "   "}, {"text": "no prompt field"},
           {"prompt": "word " * 200}]
    src = write_lines(tmp_path / "prompts.jsonl", [good[0], bad[0], good[1], bad[1], bad[2], bad[3], bad[4], good[2]])
    items, ctx, records = run_generate(tmp_path, [src], model="smollm2", max_new_tokens=10, max_prompt_tokens=100,
                                       batch_size=3, shard_records=2)
    s = ctx.summary
    assert s["skipped"] == {"invalid_utf8": 1, "invalid_json": 1, "empty": 1, "unknown_format": 1, "over_length": 1}
    skipped = [json.loads(x) for x in (Path(ctx.work_dir) / "skipped.jsonl").read_text().splitlines()]
    assert [(e["line"], e["reason"]) for e in skipped] == [(2, "invalid_utf8"), (4, "invalid_json"), (5, "empty"),
                                                         (6, "unknown_format"), (7, "over_length")]
    assert (s["prompts"], s["records_out"], s["shards"], len(items)) == (3, 3, 2, 2)

    model, tok = load_smollm2()
    eos = eos_ids(model, tok)
    prompts = [render_prompt(tok, record_messages(raw)) for raw in good]
    # records come longest prompt first (ties in file order)
    order = sorted(range(3), key=lambda i: -len(prompts[i]))
    assert [r["line"] for r in records] == [[1, 3, 8][i] for i in order]
    assert records[order.index(2)]["id"] == "sg_0"
    good, prompts = [good[i] for i in order], [prompts[i] for i in order]
    refs = [greedy_decode(model, prompt, 10, eos) for prompt in prompts]
    for rec, raw, ref in zip(records, good, refs):
        assert rec["tokens"] == len(ref) and rec["finish"] == ("stop" if ref[-1] in eos else "length")
        assert rec["messages"][:-1] == record_messages(raw)
        assert tok.decode(ref[:-1] if rec["finish"] == "stop" else ref) == rec["messages"][-1]["content"]
    assert s["generated_tokens"] == sum(r["tokens"] for r in records)

    _, tctx, rows = run_stage(tmp_path, items, tokenizer="smollm2", min_loss_tokens=1)
    assert tctx.summary["samples_out"] == 3 and tctx.summary["quarantined_total"] == 0
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for rec, prompt, ref, row in zip(records, prompts, refs, rows):
        supervised = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert row["input_ids"][:len(prompt)] == prompt
        assert supervised == (ref if rec["finish"] == "stop" else ref + [im_end])


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_target(tmp_path_factory.getbasetemp(), layers=2, hidden=32, vocab=151936)


@pytest.mark.parametrize("samples", [1, 2])
def test_resume_after_a_crash_regenerates_only_the_unfinished_shard(tmp_path: Path, qwen_tiny: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    samples: int) -> None:
    """A run that dies in its second shard file (with two samples: the first shard's second sample)
    resumes with the files not yet written, and writes each record once."""
    prompts = [{"prompt": f"Question number {i}: what is {i} squared?" + " Explain." * (i % 3)} for i in range(5)]
    src = write_lines(tmp_path / "p.jsonl", prompts)
    params = dict(model=str(qwen_tiny), max_new_tokens=8, batch_size=1, shard_records=2, temperature=0.9, seed=7,
                  samples=samples)
    _, _, whole = run_generate(tmp_path, [src], "whole", **params)
    assert len(whole) == 5 * samples and len({r["id"] for r in whole}) == 5 * samples

    real = generate_batch.complete
    calls: list[int] = []

    def crash_in_second_shard(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # one call per shard: the second shard dies
            raise RuntimeError("killed")
        return real(*a, **kw)

    monkeypatch.setattr(generate_batch, "complete", crash_in_second_shard)
    with pytest.raises(RuntimeError, match="killed"):
        run_generate(tmp_path, [src], "resumed", **params)
    shard_dir = next((tmp_path / "resumed" / "cache").iterdir())
    first = "shard-00000.jsonl" if samples == 1 else "shard-00000.s7.jsonl"
    assert sorted(p.name for p in shard_dir.iterdir()) == [first]

    calls.clear()
    monkeypatch.setattr(generate_batch, "complete", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    events: list[dict] = []
    _, ctx, resumed = run_generate(tmp_path, [src], "resumed", events, **params)
    assert len(calls) == 3 * samples - 1  # every shard file but the first
    assert ctx.summary["resumed_shards"] == 1 and ctx.summary["shards"] == 3 * samples
    assert resumed == whole
    # progress: the resumed shard moves the position, each generated completion advances it as its
    # row finishes, and only generated tokens are counted
    position = 0
    for e in (e for e in events if e["type"] == "progress"):
        position = e.get("start", position) + e["advance"]
    assert position == 5 * samples
    assert sum(e.get("tokens", 0) for e in events if e["type"] == "progress") == sum(r["tokens"] for r in resumed[2:])

    # another seed samples other completions (the seed is used), the same seed the same ones
    _, _, other = run_generate(tmp_path, [src], "other", **{**params, "seed": 8})
    assert [r["messages"][-1] for r in other] != [r["messages"][-1] for r in whole]


def test_several_sampled_completions_per_prompt_are_records_of_their_own(tmp_path: Path, qwen_tiny: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``samples: 3`` writes three records per prompt, named ``<id>#<seed>``; sample k is what a
    one-sample run with seed ``seed + k`` writes; samples of a prompt differ, a rerun writes the same
    records; a later run with more samples generates only the new ones; tokenize takes them all."""
    from tests.stages.test_tokenize import run_stage

    src = write_lines(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me about the number {i}." + " Go on." * i}
                                             for i in range(3)])
    params = dict(model=str(qwen_tiny), max_new_tokens=6, batch_size=2, shard_records=2, temperature=0.7,
                  top_p=0.95, seed=5)
    items, ctx, records = run_generate(tmp_path, [src], "three", samples=3, **params)
    assert sorted(r["id"] for r in records) == sorted(f"q{i}#{k}" for i in range(3) for k in (5, 6, 7))
    assert all(r["id"] == f"{r['id'].split('#')[0]}#{r['sample']}" for r in records)
    assert [Path(it["path"]).name for it in items] == [f"shard-{j:05d}.s{k}.jsonl" for j in (0, 1) for k in (5, 6, 7)]
    assert (ctx.summary["prompts"], ctx.summary["records_out"]) == (3, 9)
    for i in range(3):
        texts = [r["messages"][-1]["content"] for r in records if r["id"].startswith(f"q{i}#")]
        assert len(set(texts)) == 3

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "sample"} | {"id": r["id"].split("#")[0]}

    _, _, alone = run_generate(tmp_path, [src], "alone", samples=1, **{**params, "seed": 6})
    assert [r["id"] for r in alone] == ["q2", "q1", "q0"]  # a lone completion keeps its prompt's id
    assert alone == [strip(r) for r in records if r["sample"] == 6]
    _, _, again = run_generate(tmp_path, [src], "again", samples=3, **params)
    assert again == records

    real, calls = generate_batch.complete, []
    monkeypatch.setattr(generate_batch, "complete", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    _, ctx, more = run_generate(tmp_path, [src], "three", samples=4, **params)
    assert len(calls) == 2 and ctx.summary["resumed_shards"] == 6  # seed 8 of each shard only
    assert [r for r in more if r["sample"] < 8] == records and len(more) == 12

    _, tctx, _ = run_stage(tmp_path, items, tokenizer=str(qwen_tiny), min_loss_tokens=1)
    assert tctx.summary["samples_out"] == 9 and tctx.summary["quarantined_total"] == 0


def test_no_usable_prompt_fails_with_the_reasons(tmp_path: Path, qwen_tiny: Path) -> None:
    src = write_lines(tmp_path / "p.jsonl", [{"prompt": ""}, b"[1, 2]"])
    with pytest.raises(ValueError, match=r"no usable prompt.*'empty': 1.*skipped.jsonl"):
        run_generate(tmp_path, [src], model=str(qwen_tiny))


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="top_p"):
        GenerateConfig(top_p=0)
    with pytest.raises(ValueError, match=">= 1"):
        GenerateConfig(batch_size=0)
    with pytest.raises(ValueError, match="samples > 1 needs sampling"):
        GenerateConfig(samples=2)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        GenerateConfig(samples=0, temperature=0.7)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        GenerateConfig(max_batch_tokens=0)


def test_an_unset_max_batch_tokens_keeps_the_shard_folder_of_runs_before_it() -> None:
    """Shards generated before ``max_batch_tokens`` existed are found by a run that leaves it unset;
    setting it changes which rows decode side by side, so it makes a folder of its own."""
    from dataclasses import asdict

    from dflash_stages.generate.stage import sample_params, shard_key

    items = [{"path": "p.jsonl", "size": 10}]
    before = sample_params({k: v for k, v in asdict(GenerateConfig()).items() if k != "max_batch_tokens"})
    assert shard_key("2", sample_params(asdict(GenerateConfig())), items) == shard_key("2", before, items)
    assert shard_key("2", sample_params(asdict(GenerateConfig(max_batch_tokens=4096))), items) != \
        shard_key("2", before, items)


def test_prompt_messages_accept_text_parts_and_refuse_empty_ones() -> None:
    """Content given as text parts (as tokenize accepts) is a prompt; blank parts or only a system
    message are not."""
    from dflash_stages.generate.prompts import PromptError, record_messages

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi?"}]}]}
    assert record_messages(parts) == parts["messages"]
    for empty in ({"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]},
                  {"prompt": [{"role": "system", "content": "Be brief."}]}):
        with pytest.raises(PromptError, match="empty"):
            record_messages(empty)


@pytest.mark.parametrize("kind", ["dense", pytest.param("hybrid", marks=needs_hybrid)])
def test_finished_rows_leave_the_batch_and_every_row_stays_its_greedy_decode(kind: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that stop early are dropped from a dense target's cache; a hybrid's linear state has no
    row selection, so there they ride along masked. Either way each row is its prompt's own greedy
    decode, cut at its first end token (with a cache buffer that runs out of room every step)."""
    import random

    from dflash_model.target import decode_kv
    from dflash_model.target.spec_decode import greedy_decode
    from tests.stages.test_evaluate import tiny_qwen3
    from tests.stages.test_evaluate_hybrid import tiny_qwen3_5

    model = tiny_qwen3() if kind == "dense" else tiny_qwen3_5()
    rng = random.Random(0)
    prompts = [[rng.randrange(127) for _ in range(n)] for n in (3, 11, 6, 17, 8, 5, 14, 9)]
    free = [greedy_decode(model, p, 12) for p in prompts]
    eos = {free[0][1], free[1][3], free[2][5]}  # rows 0-2 (3 of 8) stop early, others where these occur
    refs = [greedy_decode(model, p, 12, eos) for p in prompts]
    assert sum(len(r) < 12 for r in refs) >= 3

    selected: list[int] = []  # rows the first layer's cache keeps, each time rows leave
    real = generate_batch._Flight.keep
    monkeypatch.setattr(generate_batch._Flight, "keep", lambda self, keep: (
        real(self, keep), selected.append(self.cache.layers[0].keys.shape[0] if len(keep) else 0))[0])
    monkeypatch.setattr(decode_kv, "ROOM", 0)
    told: list[tuple[int, int]] = []
    out = generate_batch.complete(model, prompts, batch_size=8, max_new_tokens=12, eos=sorted(eos), pad_id=0,
                                  progress=lambda rows, tokens: told.append((rows, tokens)))
    assert [c.ids for c in out] == refs
    assert len(told) == len(selected) and sum(r for r, _ in told) == len(prompts)  # told as rows left
    assert sum(t for _, t in told) == sum(len(c.ids) for c in out)
    assert [c.finish for c in out] == ["stop" if r[-1] in eos else "length" for r in refs]
    if kind == "dense":
        assert selected[:-1] and all(0 < n < len(prompts) for n in selected[:-1]) and selected[-1] == 0
    else:
        assert selected == [0]  # all at once, when the last row is done


@pytest.mark.parametrize("kind", ["dense", pytest.param("hybrid", marks=needs_hybrid)])
def test_waiting_prompts_join_the_rows_in_flight(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With more prompts than ``batch_size``, a dense target's free places are refilled while other
    rows are mid-decode (newcomers shorter and longer than the cache is wide); a hybrid's batches
    run one after another. Every row is still its prompt's own greedy decode."""
    import random

    from dflash_model.target.spec_decode import greedy_decode
    from tests.stages.test_evaluate import tiny_qwen3
    from tests.stages.test_evaluate_hybrid import tiny_qwen3_5

    model = tiny_qwen3() if kind == "dense" else tiny_qwen3_5()
    rng = random.Random(1)
    prompts = [[rng.randrange(127) for _ in range(n)] for n in (4, 30, 7, 2, 19, 9, 41, 5, 12, 3, 25, 8)]
    free = [greedy_decode(model, p, 10) for p in prompts]
    eos = {free[0][0], free[2][2], free[4][4], free[6][6]}
    refs = [greedy_decode(model, p, 10, eos) for p in prompts]
    assert len({len(r) for r in refs}) >= 4  # rows end at several steps

    in_flight_at_join: list[int] = []
    real = generate_batch._Flight.admit
    monkeypatch.setattr(generate_batch._Flight, "admit",
                        lambda self, ps, rows: (in_flight_at_join.append(len(self)), real(self, ps, rows))[1])
    out = generate_batch.complete(model, prompts, batch_size=4, max_new_tokens=10, eos=sorted(eos), pad_id=0)
    assert [c.ids for c in out] == refs
    assert generate_batch.complete(model, [], batch_size=4, max_new_tokens=10, eos=sorted(eos), pad_id=0) == []
    if kind == "dense":
        assert any(n > 0 for n in in_flight_at_join)
    else:
        assert in_flight_at_join == [0, 0, 0]


def test_max_batch_tokens_bounds_the_cache_rows_can_grow_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``max_batch_tokens`` the rows in flight at every step could all grow to their longest
    prompt + ``max_new_tokens`` within it (one row runs whatever its size): long prompts decode a few
    at a time, short ones more, up to ``batch_size``. Every row is still its own greedy decode."""
    import random

    from dflash_model.target.spec_decode import greedy_decode
    from tests.stages.test_evaluate import tiny_qwen3

    model = tiny_qwen3()
    rng = random.Random(2)
    lengths = [40, 37, 33, 30, 12, 11, 10, 9, 8, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2]  # longest first
    prompts = [[rng.randrange(127) for _ in range(n)] for n in lengths]
    free = [greedy_decode(model, p, 8) for p in prompts]
    eos = {free[0][2], free[5][4]}
    refs = [greedy_decode(model, p, 8, eos) for p in prompts]
    budget = 2 * (40 + 8) + 10  # two of the longest rows; 7 rows of 8 + 8 tokens

    steps: list[tuple[int, int]] = []  # (rows in flight, longest prompt in flight) at each decode step
    real = generate_batch._Flight.step
    monkeypatch.setattr(generate_batch._Flight, "step",
                        lambda self, tok: (steps.append((len(self), self.longest)), real(self, tok))[1])
    out = generate_batch.complete(model, prompts, batch_size=6, max_new_tokens=8, eos=sorted(eos), pad_id=0,
                                  max_batch_tokens=budget)
    assert [c.ids for c in out] == refs
    assert all(rows * (longest + 8) <= budget for rows, longest in steps)
    assert max(rows for rows, longest in steps if longest >= 30) == 2
    assert max(rows for rows, longest in steps if longest <= 12) == 6  # batch_size still caps the rows
    steps.clear()
    one = generate_batch.complete(model, prompts[:3], batch_size=6, max_new_tokens=8, eos=sorted(eos), pad_id=0,
                                  max_batch_tokens=10)  # under one row: one at a time
    assert [c.ids for c in one] == refs[:3] and {rows for rows, _ in steps} == {1}

    steps.clear()  # shortest first: a long newcomer waits until enough rows have left
    rising = generate_batch.complete(model, prompts[::-1], batch_size=6, max_new_tokens=8, eos=sorted(eos),
                                     pad_id=0, max_batch_tokens=budget)
    assert [c.ids for c in rising] == refs[::-1]
    assert all(rows * (longest + 8) <= budget or rows == 1 for rows, longest in steps)
    assert max(rows for rows, _ in steps) == 6 and max(longest for _, longest in steps) == 40


def test_top_p_keeps_the_fewest_tokens_whose_mass_reaches_it() -> None:
    import torch

    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    gen = torch.Generator().manual_seed(0)
    draw = lambda top_p: {int(generate_batch.pick(logits, 1.0, top_p, gen)) for _ in range(300)}
    assert draw(0.6) == {1, 3}  # 0.4 + 0.3 reach 0.6
    assert draw(1e-6) == {1}
    assert draw(1.0) == {0, 1, 2, 3}
    assert int(generate_batch.pick(logits, 0.0, 0.5, None)) == 1
