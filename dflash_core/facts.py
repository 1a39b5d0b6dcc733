"""Facts one stage's settings fix for another, named once.

A stage publishes facts from its config (``Stage.facts_for_consumers`` downstream,
``Stage.facts_for_producers`` to the stages feeding it); the engine hands them to the stages
they concern (``StageContext.upstream_facts`` / ``consumer_facts``) and to ``Stage.check`` at
``validate`` time (``Pipeline.upstream_facts`` / ``consumer_facts``). Each fact has one owner, so
no stage reads another's params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOKENIZER = "tokenizer"
"""tokenize → downstream: the tokenizer (path or hub name) the samples were made with."""
THINKING = "thinking"
"""tokenize → downstream: whether conversations were rendered with reasoning on."""
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
"""tokenize → downstream: the extra chat-template variables used."""
MAX_SAMPLE_TOKENS = "max_sample_tokens"
"""tokenize → downstream: no sample it yields is longer (pack's rows must hold one)."""
ROW_TOKENS = "row_tokens"
"""pack → downstream: every row it yields has exactly this many tokens (unset: rows of several
lengths). extract and train compile for that length before the first row arrives (``warm_up``)."""
SNAPSHOT_EVERY = "snapshot_every"
"""checkpoint → its producer: save every N optimizer steps exactly (0: only at the end)."""
SNAPSHOT_ABOUT_EVERY = "snapshot_about_every"
"""checkpoint → its producer: save about every N optimizer steps, each snapshot moved up to the
nearest step where the producer can take one (the user set no cadence)."""


def tokenizer_metadata(facts: Mapping[str, Any]) -> dict[str, Any]:
    """What an export records of how its training data was tokenized (None where unknown: no
    tokenize stage upstream)."""
    return {TOKENIZER: facts.get(TOKENIZER), THINKING: facts.get(THINKING),
            CHAT_TEMPLATE_KWARGS: dict(facts.get(CHAT_TEMPLATE_KWARGS) or {})}


def snapshot_cadence(consumer_facts: Mapping[str, Mapping[str, Any]]) -> tuple[int, bool]:
    """The steps between snapshots a producer owes its consumers, and whether it must keep to them
    exactly: the shortest cadence any of them asks for, an exact one before an approximate one of
    the same length ((0, True): none asks)."""
    asks = [(int(f[key]), key == SNAPSHOT_EVERY) for f in consumer_facts.values()
            for key in (SNAPSHOT_EVERY, SNAPSHOT_ABOUT_EVERY) if f.get(key)]
    return min(asks, key=lambda ask: (ask[0], not ask[1])) if asks else (0, True)
