"""The items that flow pack → extract → train, declared once.

A pack stage (built-in or a plugin's) yields **packed rows**; extract passes every field through
and adds the target's features, giving **feature rows**; the trainer reads both kinds of field.
Some fields matter only for bookkeeping the trainer does silently (the LR schedule's length, the
resume cursor), so a producer that left them out would train "fine" with a flat schedule and a
resume that starts over. Each consuming stage therefore checks the rows it is given where the
stream enters it (:func:`checked`), and a missing field is an error naming the stage that should
have written it. docs/pack.md documents every field (a test keeps it so).

Producers build rows with :func:`packed_row`, :func:`producer_fields` and :func:`feature_row`, so
that the field names are spelled here only. Extract's stream to train starts with a **target
header** (``kind: "target"``, :data:`TARGET_HEADER`, which train checks with :func:`check_fields`);
its rows are marked ``kind: "row"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dflash_core.items import KIND, Field, ItemError, ItemType, check_fields, source_of

ROW_KIND = "row"
TARGET_KIND = "target"
HOME = "dflash_core.rows, docs/pack.md"

RowError = ItemError
"""A row is missing fields, or its per-token fields disagree in length (the name rows.py gave
:class:`~dflash_core.items.ItemError` before every link had a type)."""


PACKED_ROW = ItemType("packed row", (
    Field("input_ids", "int [T]: the row's tokens, documents back to back"),
    Field("loss_mask", "0/1 [T]: tokens the drafter is trained to predict"),
    Field("position_ids", "int [T]: positions restarting at 0 for every document"),
    Field("doc_lengths", "ints summing to T: the documents (trailing padding as a last entry)"),
    Field("state", "the producer's cursor after this row (JSON-able), saved with checkpoints and "
                   "handed back as ctx.resume_state on --resume"),
    Field("state_stage", "the pipeline name of the stage whose cursor `state` is"),
    Field("epochs", "how many epochs the producer yields: with rows_per_epoch, the LR schedule's length"),
    Field("rows_per_epoch", "rows one producer rank yields per epoch"),
), home=HOME)
"""What pack writes and extract reads."""

FEATURE_ROW = PACKED_ROW.extend(
    "feature row",
    Field("features", "tensor [T, k·H]: the chosen target layers' outputs, concatenated"),
    optional=(Field("last_hidden", "tensor [T, H] or None: the target's final-normed last hidden state"),
              Field(KIND, f"{ROW_KIND!r}: tells a row from the target header in extract's stream")),
)
"""What extract writes (a packed row plus the target's features) and train reads."""

TARGET_HEADER = ItemType("target header", (
    Field(KIND, f"{TARGET_KIND!r}"),
    Field("model", "the target's name as the extract stage was given it"),
    Field("config", "the target's config as a dict"),
    Field("target_layer_ids", "the layers whose outputs make up `features`, in order"),
    Field("embed_weight", "tensor [V, H]: the target's input embedding (frozen, shared with the drafter)"),
    Field("lm_head_weight", "tensor [V, H]: the target's LM head (frozen, shared with the drafter)"),
    Field("tokenizer_len", "the tokenizer's size (the drafter's mask token is picked beyond it)"),
    Field("all_special_ids", "the tokenizer's special token ids"),
), kind=TARGET_KIND, home=HOME)
"""The first item of extract's stream: what the trainer needs of the target."""


def packed_row(input_ids: Any, loss_mask: Any, position_ids: Any, doc_lengths: Any, **extra: Any) -> dict[str, Any]:
    """A row's per-token fields (documents back to back) and a producer's own fields ``extra``."""
    return {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids,
            "doc_lengths": doc_lengths, **extra}


def producer_fields(*, state: Any, stage: str, epochs: int, rows_per_epoch: int) -> dict[str, Any]:
    """The bookkeeping fields of a packed row: the producer's cursor after it and whose it is, and
    the LR schedule's length (epochs × rows per epoch)."""
    return {"state": state, "state_stage": stage, "epochs": epochs, "rows_per_epoch": rows_per_epoch}


def feature_row(row: Mapping[str, Any], features: Any, last_hidden: Any = None) -> dict[str, Any]:
    """A packed row with the target's features: what extract yields after the target header."""
    return {**row, KIND: ROW_KIND, "features": features, "last_hidden": last_hidden}


def is_row(item: Any) -> bool:
    """A row of the stream (not a header or another marked item): unmarked items count as rows."""
    return not (isinstance(item, Mapping) and item.get(KIND, ROW_KIND) != ROW_KIND)


def is_target_header(item: Any) -> bool:
    return isinstance(item, Mapping) and item.get(KIND) == TARGET_KIND


def check_row(row: Any, schema: ItemType, consumer: str, producer: str | None) -> None:
    """Raise :class:`RowError` naming ``producer`` if ``row`` does not fit ``schema``: a field is
    missing, or the per-token fields disagree in length."""
    check_fields(row, schema, consumer, producer)
    source = source_of(producer)
    total = len(row["input_ids"])
    uneven = [n for n in ("loss_mask", "position_ids") if len(row[n]) != total]
    if uneven or sum(int(n) for n in row["doc_lengths"]) != total:
        raise RowError(f"stage {consumer!r} got a {schema.name} from {source} whose fields disagree: "
                       f"{total} input_ids, " + ", ".join(f"{len(row[n])} {n}" for n in ("loss_mask", "position_ids"))
                       + f", doc_lengths summing to {sum(int(n) for n in row['doc_lengths'])}")


def checked(items: Iterable[Any], schema: ItemType, consumer: str, producer: str | None) -> Iterator[Any]:
    """``items`` with every row checked against ``schema`` as it arrives; other items (marked with
    a ``kind`` other than "row", such as extract's target header) pass unchecked."""
    for item in items:
        if is_row(item):
            check_row(item, schema, consumer, producer)
        yield item
