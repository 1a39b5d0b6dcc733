"""Fixtures shared by the stage tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stages.online_fixtures import tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, hidden 64, vocab 6000 (mask token 5999), real Qwen3 tokenizer."""
    return tiny_target(tmp_path_factory.getbasetemp())
