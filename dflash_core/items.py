"""What travels on each link between stages, declared once: the item types and their checks.

A stage declares the type of each input port (``inputs = {"rows": PACKED_ROW}``) and of what it
yields (``output = FEATURE_ROW``). ``dflash-pipe validate`` refuses a link whose producer's output
does not fit the consumer's port (:func:`misfit`), naming both ends at the file's line, and each
consuming stage checks the items where the stream enters it (:func:`check_fields`,
:func:`checked`, :func:`of_kind`), so that a third-party producer that left a field out fails
there, naming itself, instead of somewhere downstream. The row types (packed row, feature row,
target header) are in :mod:`dflash_core.rows`; the others are here.

On the wire every item stays a plain dict (JSON where the link is materialized): a type names the
fields it must carry (more are allowed and passed along) and, for the types whose items share a
stream with others, the ``kind`` value that marks them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

KIND = "kind"
"""The key that marks an item with its type where one stream carries several (a header, a row)."""


@dataclass(frozen=True)
class Field:
    name: str
    meaning: str


@dataclass(frozen=True)
class ItemType:
    """The fields an item of one type must carry; more are allowed and passed along."""

    name: str
    fields: tuple[Field, ...]
    optional: tuple[Field, ...] = ()
    """Fields a consumer reads when present (not checked)."""
    kind: str | None = None
    """The value of ``kind`` that marks these items (None: unmarked)."""
    home: str = "dflash_core.items"
    """Where the type is documented, for error messages."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def extend(self, name: str, *fields: Field, optional: tuple[Field, ...] = ()) -> "ItemType":
        """A type whose items carry this one's fields and ``fields``."""
        return ItemType(name, self.fields + fields, self.optional + optional, self.kind, self.home)

    def matches(self, item: Any) -> bool:
        """``item`` is a mapping with this type's marker (if it has one) and every field."""
        return (isinstance(item, Mapping) and (self.kind is None or item.get(KIND) == self.kind)
                and all(n in item for n in self.names))


PortType = Union[ItemType, tuple[ItemType, ...], None]
"""What an input port accepts: one type, any of several, or (None) anything."""


def accepted(port: PortType) -> tuple[ItemType, ...] | None:
    """The types a port accepts, or None for an untyped port."""
    if port is None:
        return None
    return port if isinstance(port, tuple) else (port,)


def describe(port: PortType) -> str:
    types = accepted(port)
    return "anything" if types is None else " or ".join(f"{t.name}s" for t in types)


def port_types(stage_cls: Any) -> dict[str, PortType]:
    """Port -> accepted type(s) of a stage class; ports declared as a plain tuple of names (the
    older form, still valid for third-party stages) are untyped."""
    inputs = stage_cls.inputs
    if isinstance(inputs, Mapping):
        return dict(inputs)
    return {port: None for port in inputs}


def misfit(output: ItemType | None, port: PortType) -> str | None:
    """Why items of type ``output`` do not fit ``port`` (None when they do). An undeclared side
    fits anything; else the output must carry one accepted type's fields (and its marker)."""
    types = accepted(port)
    if output is None or types is None:
        return None
    reasons = []
    for want in types:
        missing = [n for n in want.names if n not in output.names]
        if want.kind != output.kind and want.kind is not None:
            reasons.append(f"{want.name}s are marked kind={want.kind!r}, {output.name}s "
                           f"{'kind=' + repr(output.kind) if output.kind else 'are unmarked'}")
        elif missing:
            reasons.append(f"{output.name}s lack {', '.join(repr(n) for n in missing)} of a {want.name}")
        else:
            return None
    return "; ".join(reasons)


class ItemError(ValueError):
    """An item that entered a stage does not fit the type its port declares."""


def source_of(producer: str | None) -> str:
    """How messages name the stage that sent an item."""
    return f"stage {producer!r}" if producer else "its upstream stage"


def check_fields(item: Any, schema: ItemType, consumer: str, producer: str | None) -> None:
    """Raise :class:`ItemError` naming ``producer`` if ``item`` lacks a field of ``schema``."""
    source = source_of(producer)
    if not isinstance(item, Mapping):
        raise ItemError(f"stage {consumer!r} expects {schema.name}s (mappings) from {source}, "
                        f"got {type(item).__name__}")
    missing = [n for n in schema.names if n not in item]
    if missing:
        raise ItemError(f"stage {consumer!r} got a {schema.name} from {source} without "
                        f"{', '.join(repr(n) for n in missing)}; a {schema.name} carries "
                        f"{', '.join(schema.names)} ({schema.home})")


def checked(items: Iterable[Any], port: ItemType | tuple[ItemType, ...], consumer: str,
            producer: str | None) -> Iterator[Any]:
    """``items`` as they arrive, each one fitting one of the ``port``'s types, else an
    :class:`ItemError` that names both stages and what was expected."""
    types = accepted(port) or ()
    for item in items:
        if len(types) == 1:
            check_fields(item, types[0], consumer, producer)
        elif not any(t.matches(item) for t in types):
            raise ItemError(f"stage {consumer!r} expects {describe(port)} from {source_of(producer)}, "
                            f"got {str(item)[:120]!r}; "
                            + "; ".join(f"a {t.name} carries {', '.join(t.names)}" for t in types)
                            + f" ({types[0].home})")
        yield item


def of_kind(items: Iterable[Any], schema: ItemType, consumer: str, producer: str | None) -> Iterator[Any]:
    """The items marked as ``schema.kind``, each checked; items marked otherwise are for other
    consumers of the same stream and are passed over."""
    for item in items:
        if isinstance(item, Mapping) and item.get(KIND) == schema.kind:
            check_fields(item, schema, consumer, producer)
            yield item


# ------------------------------------------------------------------------------ the types

FILE_ITEM = ItemType("file item", (
    Field("path", "local path or fsspec URL of one file (JSONL records for tokenize and generate)"),
), optional=(
    Field("source", "the name the file is known by (its URL at the source): tokenize orders files by it"),
    Field("size", "bytes"),
    Field("etag", "the source's version tag, when it has one"),
    Field("records", "records in the file (generate's shards)"),
))
"""What download and generate yield and tokenize and generate read."""

SAMPLE_SHARD = ItemType("sample shard", (
    Field("shard", "URL of an Arrow IPC file with columns input_ids list<int32>, loss_mask list<int8> "
                   "(and source, line): one tokenized sample a row"),
), optional=(
    Field("index", "the shard's number, in the order tokenize wrote them"),
    Field("samples", "rows in the shard"),
    Field("tokens", "tokens in the shard"),
    Field("loss_tokens", "supervised tokens in the shard"),
))
"""What tokenize yields and pack reads (``dflash_core.samples.SampleIndex`` reads them)."""

SAMPLE = ItemType("sample", (
    Field("input_ids", "ints: one tokenized sample"),
), optional=(
    Field("loss_mask", "0/1 per token, 1 where the drafter learns (default: every token)"),
))
"""One tokenized sample given inline instead of in a shard (tests, small plugins)."""

SAMPLE_SOURCES = (SAMPLE_SHARD, SAMPLE, FILE_ITEM)
"""What a pack stage's port takes: sample shards, inline samples, or file items naming Arrow
shards (all three read by ``dflash_core.samples.SampleIndex``)."""

TRAIN_STATE = ItemType("train state", (
    Field("step", "optimizer steps taken"),
    Field("final", "True for the state at the end of training"),
    Field("rank", "the trainer's rank among its replicas (rank 0 writes the checkpoint)"),
    Field("model", "the drafter's state dict, on the CPU"),
    Field("optimizer", "the optimizer's state dict, on the CPU"),
    Field("rng", "this rank's RNG states ({'cpu': tensor, …})"),
    Field("drafter_config", "the drafter's config (its export is built from it)"),
    Field("pipeline_state", "stage -> the cursor --resume hands it back (the trainer's step, pack's position)"),
    Field("metadata", "what the export records for serving and evaluation: target, tokenizer, thinking, "
                      "chat_template_kwargs, heldout, metrics, step"),
), optional=(
    Field("interrupted", "True when a signal stopped training at this state"),
    Field("world_size", "the trainer's replica count"),
    Field("metrics_file", "the metrics JSONL to copy into the checkpoint"),
), kind="state")
"""What a trainer yields (snapshots, the last one ``final``) and checkpoint saves."""

CHECKPOINT = ItemType("checkpoint", (
    Field("step", "the step saved"),
    Field("final", "True for the checkpoint at the end of training"),
    Field("export", "its served-format export directory (what evaluate serves)"),
), optional=(
    Field("path", "the checkpoint directory"),
), kind="checkpoint")
"""What checkpoint yields once a checkpoint is complete, and evaluate reads."""

EVAL_REPORT = ItemType("evaluation report", (
    Field("step", "the checkpoint's step"),
    Field("final", "True for the final checkpoint"),
    Field("tau", "served τ: mean accepted drafts + 1 per speculative cycle"),
    Field("tau_ngram", "τ of the n-gram (prompt lookup) baseline, or None"),
    Field("tau_sim", "τ the training code predicts on the same text, or None"),
    Field("gap", "(τ_sim − τ) / τ_sim, or None"),
    Field("gap_flag", "True when |gap| is over the stage's threshold"),
    Field("lossless", "True when every output equals the target's greedy decode"),
    Field("warnings", "lines worth a look (a flagged gap, near ties, a lossless failure)"),
), kind="eval_report")
"""What evaluate yields per evaluated checkpoint (docs/evaluate.md lists the rest of its fields)."""

METRICS_RECORD = ItemType("metrics record", (
    Field("step", "optimizer steps taken when the record was written"),
    Field("loss", "mean loss over the window since the last record"),
    Field("acc", "mean draft accuracy over the window"),
    Field("tau_sim", "mean simulated τ over the window"),
    Field("lr", "learning rate of the last step"),
    Field("grad_norm", "gradient norm before clipping, last step"),
    Field("tokens_per_s", "tokens trained per second over the window"),
    Field("tokens", "tokens trained since the run (or its resume) started"),
    Field("elapsed_s", "seconds of training since the run (or its resume) started"),
), optional=(
    Field("epoch", "epochs of the pack stage's plan the record's step has trained (where rows carry the plan)"),
    Field("tau_serve", "mean τ counting only whole draft blocks"),
    Field("time", "wall-clock time (Unix seconds)"),
    Field("per_slot_acc", "accuracy per draft position, last step"),
    Field("row_wait_share", "share of the window's seconds the loop waited for its rows (fed too "
                            "slowly from upstream) rather than stepping"),
    Field("val_loss", "mean loss over the window's validation documents (train validation_share)"),
    Field("val_acc", "mean draft accuracy over the window's validation documents"),
    Field("val_tau_sim", "mean simulated τ over the window's validation documents"),
    Field("val_tau_serve", "τ of a served decode walked over the window's validation documents"),
    Field("val_cycles", "the cycles val_tau_serve is the mean of"),
))
"""One line of a trainer's metrics JSONL (``<run_dir>/metrics.jsonl``); evaluate reads it."""
