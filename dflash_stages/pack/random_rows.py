"""pack:random — packed rows of random tokens in the pack stage's row format.

For benchmarks and smoke runs at production shapes without data: every row has the same
length and document split, so timings do not depend on the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from dflash_core import Stage, StageContext
from dflash_core.facts import ROW_TOKENS
from dflash_core.rows import PACKED_ROW, packed_row, producer_fields


@dataclass
class RandomRowsConfig:
    rows: int = field(default=16, metadata={"help": "rows per rank"})
    tokens_per_row: int = field(default=8192, metadata={"help": "tokens in each row"})
    docs_per_row: int = field(default=3, metadata={"help": "documents of equal length in each row"})
    prompt_fraction: float = field(default=0.1, metadata={"help": "unsupervised head of each doc"})
    vocab_size: int = field(default=32000, metadata={"help": "token ids are drawn from 0 to this"})
    seed: int = field(default=0, metadata={"help": "with the row's index, seeds its tokens"})


def random_row(cfg: RandomRowsConfig, index: int) -> dict[str, Any]:
    """Row ``index``: ``docs_per_row`` equal documents, each with an unsupervised prompt."""
    import numpy as np

    rng = np.random.default_rng([cfg.seed, index])
    base, rest = divmod(cfg.tokens_per_row, cfg.docs_per_row)
    lengths = [base + (i < rest) for i in range(cfg.docs_per_row)]
    mask = np.ones(cfg.tokens_per_row, dtype=np.uint8)
    pos = np.concatenate([np.arange(n) for n in lengths])
    start = 0
    for n in lengths:
        mask[start:start + int(n * cfg.prompt_fraction)] = 0
        start += n
    return packed_row(rng.integers(0, cfg.vocab_size, cfg.tokens_per_row, dtype=np.int64), mask,
                      pos.astype(np.int64), lengths)


def warm_up_row(header: Mapping[str, Any], tokens: int) -> dict[str, Any]:
    """A row of ``tokens`` random tokens (three documents) of the target that extract's ``header``
    describes: what extract and train compile on before their first row (``warm_up``)."""
    vocab = min(int(header["tokenizer_len"]), int(header["embed_weight"].shape[0]))
    return random_row(RandomRowsConfig(rows=1, tokens_per_row=tokens, vocab_size=vocab), 0)


class RandomRows(Stage):
    kind = "pack"
    name = "random"
    Config = RandomRowsConfig
    inputs = ()
    output = PACKED_ROW

    @classmethod
    def facts_for_consumers(cls, config: RandomRowsConfig) -> Mapping[str, Any]:
        """Every row has ``tokens_per_row`` tokens."""
        return {ROW_TOKENS: config.tokens_per_row}

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        start = int((ctx.resume_state or {}).get("position", 0))
        for i in range(start, self.config.rows):
            row = random_row(self.config, i * ctx.world_size + ctx.rank)
            row.update(producer_fields(state={"position": i + 1}, stage=ctx.stage, epochs=1,
                                       rows_per_epoch=self.config.rows))
            ctx.progress(1, total=self.config.rows, unit="rows", tokens=self.config.tokens_per_row)
            yield row
