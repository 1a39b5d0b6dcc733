"""Shared fixtures: the S3 server (tests/s3_fixtures.py) and helpers to drive the CLI.

The CLI is driven two ways: ``cli`` calls ``dflash_core.cli.main.main`` in this process
(fast; output captured), ``cli_subprocess`` runs ``python -m dflash_core.cli.main`` (or the
``dflash-pipe`` console script) in a fresh interpreter, which is what a user gets and what
entry-point discovery through ``PYTHONPATH`` needs. Both load the built-in plugin and those the
test names (``-p``), not the entry points installed in the environment (a plugin author runs this
suite beside their own plugin); a test of entry-point discovery asks for them (``autoload``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch

from dflash_core.plugins import AUTOLOAD_ENV

if not torch.cuda.is_available():
    # Triton kernels (dflash_model/fast/adamw_triton.py, loss_triton.py) are tested through Triton's interpreter
    # on machines without a GPU; it is chosen when triton is first imported, so before any test
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.s3_fixtures import *  # noqa: F401,F403  (moto_server, s3_env, fault_proxy, …)

REPO = Path(__file__).resolve().parents[1]
STAGES = "tests.core.engine_stages"
WIDE = "250"  # rich wraps tables at 80 columns when not on a terminal; keep rows on one line


@dataclass
class CLIResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def lines_with(self, *words: str) -> list[str]:
        """Output lines that contain every one of ``words``."""
        return [ln for ln in self.text.splitlines() if all(w in ln for w in words)]


@pytest.fixture
def write_pipeline(tmp_path: Path) -> Callable[..., Path]:
    """``write_pipeline(yaml_text, name="pipeline.yaml")``: dedent, add version/run_dir, write."""

    def write(text: str, name: str = "pipeline.yaml", run_dir: str | None = None) -> Path:
        text = textwrap.dedent(text)
        if "run_dir:" not in text:
            text = f"run_dir: {run_dir or tmp_path / 'run'}\n" + text
        if "version:" not in text:
            text = "version: 1\n" + text
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CLIResult]:
    """Run the CLI in this process: ``cli("run", "-p", STAGES, path)`` -> CLIResult. Entry points
    are not loaded (a test that wants them deletes ``AUTOLOAD_ENV``)."""
    from dflash_core.cli.main import main

    monkeypatch.setenv("COLUMNS", WIDE)
    monkeypatch.setenv(AUTOLOAD_ENV, "1")

    def run(*argv: Any) -> CLIResult:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CLIResult(code, captured.out, captured.err)

    return run


def cli_env(pythonpath: Sequence[os.PathLike[str] | str] = (), autoload: bool = False,
            **extra: str | None) -> dict[str, str]:
    """This environment for a CLI subprocess: ``pythonpath`` and the repository on PYTHONPATH, entry
    points loaded only with ``autoload``; ``extra`` sets variables (None removes one)."""
    env = {k: v for k, v in os.environ.items() if k not in (AUTOLOAD_ENV, "PYTHONPATH")}
    if not autoload:
        env[AUTOLOAD_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(REPO)])
    env["COLUMNS"] = WIDE
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.fixture
def cli_subprocess() -> Callable[..., CLIResult]:
    """``cli_subprocess(*argv, pythonpath=(), autoload=False, env=None, script=False, timeout=120)``."""

    def run(*argv: Any, pythonpath: Sequence[Any] = (), autoload: bool = False,
            env: dict[str, str | None] | None = None, script: bool = False, timeout: float = 120) -> CLIResult:
        cmd = ([str(Path(sys.executable).with_name("dflash-pipe"))] if script
               else [sys.executable, "-m", "dflash_core.cli.main"])
        proc = subprocess.run(cmd + [str(a) for a in argv], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout,
                              env=cli_env(pythonpath, autoload, **(env or {})))
        return CLIResult(proc.returncode, proc.stdout, proc.stderr)

    return run


_BATCH = """
import contextlib, io, json, sys
from dflash_core.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append([code, out.getvalue(), err.getvalue()])
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture
def cli_batch() -> Callable[..., list[CLIResult]]:
    """Several CLI invocations in ONE fresh interpreter (``main(argv)`` each, output captured
    per call): what a user's shell would see, without paying interpreter start-up each time.
    ``cli_batch([argv, ...], pythonpath=(), autoload=False, env=None)`` -> [CLIResult, ...]."""
    import json

    def run(calls: Sequence[Sequence[Any]], pythonpath: Sequence[Any] = (), autoload: bool = False,
            env: dict[str, str | None] | None = None, timeout: float = 120) -> list[CLIResult]:
        argvs = [[str(a) for a in argv] for argv in calls]
        proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(argvs)], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout,
                              env=cli_env(pythonpath, autoload, **(env or {})))
        assert "RESULTS " in proc.stdout, proc.stdout + proc.stderr
        return [CLIResult(*r) for r in json.loads(proc.stdout.rsplit("RESULTS ", 1)[1])]

    return run


# ----------------------------------------------------------------- pip-installed plugins
BROKEN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "dflash-pipe-broken"
version = "0.0.1"

[project.entry-points.dflash_pipe]
broken = "dflash_pipe_broken.plugin"

[tool.setuptools]
packages = ["dflash_pipe_broken"]
"""

BROKEN_PLUGIN = '''\
"""A plugin whose dependency is not installed: importing it raises ImportError."""
import dflash_pipe_broken_missing_dependency  # noqa: F401

from dflash_core import hookimpl


@hookimpl
def dflash_pipe_register_stages(registry):
    pass
'''


@dataclass
class InstalledPlugins:
    example: Path
    """``--target`` dir holding the pip-installed plugins/dflash-pipe-example."""
    broken: Path
    """``--target`` dir holding a plugin distribution whose module raises ImportError."""


def _pip_install(source: Path, target: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(target),
         str(source)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="session")
def installed_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledPlugins]:
    """Really ``pip install`` the example plugin and a broken one, each into its own target dir.

    The sources are copied first so that the build (build/, *.egg-info) never touches the repo.
    """
    root = tmp_path_factory.mktemp("plugins")
    example_src = root / "src-example"
    shutil.copytree(REPO / "plugins" / "dflash-pipe-example", example_src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    broken_src = root / "src-broken"
    (broken_src / "dflash_pipe_broken").mkdir(parents=True)
    (broken_src / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (broken_src / "dflash_pipe_broken" / "__init__.py").write_text("")
    (broken_src / "dflash_pipe_broken" / "plugin.py").write_text(BROKEN_PLUGIN)
    installed = InstalledPlugins(root / "site-example", root / "site-broken")
    installs = [_pip_install(example_src, installed.example),  # both at once: pip is slow
                _pip_install(broken_src, installed.broken)]
    for proc, source in zip(installs, (example_src, broken_src)):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"pip install {source} failed:\n{out}"
    yield installed


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The real Qwen3 tokenizer (test asset), unpacked into a temp dir."""
    from tests.assets import unpack_qwen3_tokenizer

    return str(unpack_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer")))


@pytest.fixture(scope="session")
def qwen3(qwen3_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir, local_files_only=True)


@pytest.fixture(scope="session")
def qwen3_6_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Qwen3.5/3.6 tokenizer with Qwen3.6's chat template (tests/assets), unpacked."""
    from tests.assets import QWEN3_6_TOKENIZER, unpack_tokenizer

    return str(unpack_tokenizer(QWEN3_6_TOKENIZER, tmp_path_factory.mktemp("qwen3_6-tokenizer")))


@pytest.fixture(scope="session")
def qwen3_6(qwen3_6_dir: str) -> Any:
    from dflash_model.target.compat import auto_tokenizer

    return auto_tokenizer(qwen3_6_dir, local_files_only=True)
