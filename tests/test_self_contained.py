"""The repository is self-contained: the files its tests read are inside it, and none of its files
points at the folder beside it that only a development checkout has, so a clone with nothing
beside it passes its tests."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest

from tests.assets import QWEN3_6_TOKENIZER, QWEN3_TOKENIZER
from tests.conftest import REPO

BESIDE = "/".join(("..", "shared")).encode()
"""That folder's relative path (spelt out, this file would hold it)."""


def test_the_test_assets_are_files_of_the_repository() -> None:
    spec = importlib.util.spec_from_file_location("served_loaders", REPO / "tests" / "drafter" / "served_loaders.py")
    served_loaders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served_loaders)  # stdlib imports only: it runs under other transformers
    for asset, files in ((QWEN3_TOKENIZER, ("tokenizer.json.gz", "tokenizer_config.json", "README.md")),
                         (QWEN3_6_TOKENIZER, ("tokenizer.json.xz", "tokenizer_config.json", "README.md")),
                         (served_loaders.REFERENCE, ("__init__.py", "model.py", "LICENSE", "README.md"))):
        assert asset.resolve().is_relative_to(REPO), asset
        for name in files:
            assert (asset / name).is_file(), asset / name


def test_no_file_refers_to_a_folder_beside_the_repository() -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: its files are not known")
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    outside = [name for name in names if (REPO / name).is_file()
               and BESIDE in (REPO / name).read_bytes()]
    assert outside == []
