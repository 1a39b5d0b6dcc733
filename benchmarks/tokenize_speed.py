"""Benchmark tokenize:chat_template against a naive per-sample ``apply_chat_template`` loop.

Generates N deterministic synthetic records (multi-paragraph answer + reasoning, ~2,000 tokens
each), runs the stage (``--workers``, default 2) and then a per-sample
``tokenizer.apply_chat_template(messages, tokenize=True, enable_thinking=True)`` loop on the same
records, and prints tokens/s of both and the ratio (goal: >= 4x). The stage's tokens are checked
against the loop's for every record.

    python benchmarks/tokenize_speed.py                       # Qwen3 tokenizer of the test assets
    python benchmarks/tokenize_speed.py --asset qwen3_6       # Qwen3.5/3.6 tokenizer (tests/assets)
    python benchmarks/tokenize_speed.py --records 2000 --tokenizer Qwen/Qwen3-8B
"""

from __future__ import annotations

import sys
from pathlib import Path

import argparse
import json
import os
import random
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.assets import QWEN3_6_TOKENIZER, QWEN3_TOKENIZER, unpack_tokenizer  # noqa: E402

ASSETS = {"qwen3": QWEN3_TOKENIZER, "qwen3_6": QWEN3_6_TOKENIZER}

_COMMON = ("the of and to in is that for it as was with be by on not this are or from at which "
           "but have an they we can if so all when there one would what will their more about "
           "into than then these some only also two first may like time between because").split()
_SYLLABLES = ("ka to re mi sa lo ne vi da pu ter ion ing al ex con pro tion ber ly com pre sub "
              "ment ous ive ant form struct graph log").split()


def make_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(30000)]

    def sentence() -> str:
        words = [rng.choice(_COMMON) if rng.random() < 0.55 else rng.choice(vocab)
                 for _ in range(rng.randint(8, 24))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), f"{rng.randint(0, 99999)}.{rng.randint(0, 99)}")
        if rng.random() < 0.1:
            words.append(f"`x_{rng.randint(0, 9)} = f({rng.randint(0, 9)})`")
        return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", ":"])

    def paragraphs(k: int, sentences: int) -> str:
        return "\n\n".join(" ".join(sentence() for _ in range(sentences)) for _ in range(k))

    return [{"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": paragraphs(1, 4)},
        {"role": "assistant", "reasoning_content": paragraphs(6, 5), "content": paragraphs(6, 5)},
    ]} for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--tokenizer", default=None, help="HF path or hub name (default: --asset)")
    ap.add_argument("--asset", choices=sorted(ASSETS), default="qwen3", help="test-asset tokenizer")
    args = ap.parse_args()

    import pyarrow.ipc as ipc
    from transformers import AutoTokenizer

    from dflash_core.stage import StageContext
    from dflash_stages.tokenize.stage import ChatTemplateTokenize, TokenizeConfig

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tok_name = args.tokenizer or str(unpack_tokenizer(ASSETS[args.asset], tmp / "tokenizer"))
        records = make_records(args.records)
        data = tmp / "bench.jsonl"
        with open(data, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

        cfg = TokenizeConfig(tokenizer=tok_name, workers=args.workers, batch_size=args.batch_size,
                             max_len=1 << 16, thinking=True)
        events: list[tuple[float, int]] = []
        ctx = StageContext(stage="tokenize", config=cfg, work_dir=str(tmp / "out"),
                           emitter=lambda _s, e: events.append((time.perf_counter(), e.get("tokens", 0))))
        t0 = time.perf_counter()
        shards = list(ChatTemplateTokenize(cfg).run({"files": [{"path": str(data), "source": "bench"}]}, ctx))
        t_stage = time.perf_counter() - t0
        stage_tokens = sum(s["tokens"] for s in shards)
        # after start-up: from the first batch result to the last (spawn + imports excluded)
        steady = sum(n for _, n in events[1:]) / max(1e-9, events[-1][0] - events[0][0])
        t_first = events[0][0] - t0

        tok = AutoTokenizer.from_pretrained(tok_name)
        t0 = time.perf_counter()
        naive = []
        for r in records:
            enc = tok.apply_chat_template(r["messages"], tokenize=True, enable_thinking=True)
            naive.append(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)
        t_naive = time.perf_counter() - t0
        naive_tokens = sum(len(x) for x in naive)

        got = []
        for s in shards:
            got.extend(ipc.open_file(s["shard"]).read_all()["input_ids"].to_pylist())
        same = len(got) == len(naive) and all(a == list(b) for a, b in zip(got, naive))

    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}  cpus: {os.cpu_count()}  "
          f"python: {sys.version.split()[0]}  tokenizer: {args.tokenizer or args.asset}")
    print(f"records: {args.records}  tokens: {stage_tokens:,} "
          f"({stage_tokens / max(1, args.records):,.0f}/record), "
          f"supervised: {ctx.summary['loss_tokens']:,}")
    naive_rate = naive_tokens / t_naive
    print(f"stage, workers={args.workers}, end to end (spawn + imports + tokenizer load "
          f"{t_first:.1f} s to the first batch, shard writes): {t_stage:.2f} s  "
          f"{stage_tokens / t_stage:,.0f} tokens/s  ({stage_tokens / t_stage / naive_rate:.2f}x)")
    print(f"stage, workers={args.workers}, after start-up: {steady:,.0f} tokens/s  "
          f"({steady / naive_rate:.2f}x)")
    print(f"naive apply_chat_template(tokenize=True) loop (tokenizer loaded before timing): "
          f"{t_naive:.2f} s  {naive_rate:,.0f} tokens/s")
    print(f"same token ids as the loop: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
