"""The decoding, evaluate, extract, generate and tokenize tests (and one short training run) once
more, under the lowest transformers dflash-pipe supports (pyproject's ``transformers>=``), in a
pytest of its own: ``bash scripts/install.sh test`` installs that version beside the newest into
``.venv-tf457`` (the rest comes from ``.venv``), so the README's one test command covers both ends
of the supported range. Tests of hybrid targets, which need a newer transformers, skip there
(``tests/transformers_versions.py``) and ``test_transformers_versions.py`` checks the error such a
target gets instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LOWEST = REPO / ".venv-tf457"
FILES = ["tests/target/test_decode_kv.py", "tests/stages/test_generate.py", "tests/target/test_spec_batch.py",
         "tests/stages/test_evaluate.py", "tests/stages/test_evaluate_hybrid.py",
         "tests/stages/test_evaluate_pitfalls.py", "tests/stages/test_ngram_split.py", "tests/stages/test_extract.py",
         "tests/stages/test_hybrid_extract.py", "tests/target/test_packed_attention.py",
         "tests/target/test_qwen3_6_target.py", "tests/stages/test_tokenize.py", "tests/stages/test_tokenize_fast.py",
         "tests/stages/test_tokenize_qwen3_6.py", "tests/target/test_transformers_versions.py",
         "tests/target/test_smollm2_target.py", "tests/stages/test_online_train.py::test_short_run_learns_and_exports"]


def declared_floor() -> str:
    """The lowest transformers pyproject.toml admits."""
    found = re.search(r'"transformers>=([0-9.]+)[",]', (REPO / "pyproject.toml").read_text())
    assert found, "pyproject.toml declares no transformers>= floor"
    return found[1]


def test_decoding_evaluate_extract_and_tokenize_pass_under_the_lowest_transformers(tmp_path: Path) -> None:
    if not (LOWEST / "transformers").is_dir():
        pytest.fail(f"the lowest supported transformers is missing from {LOWEST}: run `bash scripts/install.sh test`")
    env = dict(os.environ, PYTHONPATH=str(LOWEST))
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    floor = declared_floor()
    assert version == floor, f"{LOWEST} holds transformers {version}, pyproject declares >={floor}"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "lowest"), *FILES],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    report = f"under transformers {version}:\n{proc.stdout[-12000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert re.search(r"\b[1-9][0-9]* passed", proc.stdout), report  # not everything skipped
