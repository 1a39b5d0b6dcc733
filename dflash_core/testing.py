"""A pytest fixture for plugin authors: run a pipeline in a temporary run dir.

Installed as a pytest plugin (entry point ``pytest11``), so a plugin's own tests can write::

    def test_my_stage(dflash_run):
        result = dflash_run('''
            stages:
              source: {uses: my_source}
              mine:   {uses: my_stage, after: source}
        ''')
        assert result.results["mine"].status == "done"
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest


@dataclass
class PipelineRun:
    pipeline: Any
    results: dict[str, Any]
    run_dir: Path


@pytest.fixture
def dflash_run(tmp_path: Path) -> Callable[..., PipelineRun]:
    """Call with YAML text (``version``/``run_dir`` optional); returns the stage results.

    ``plugins`` names extra plugin modules or objects to load beside the installed ones.
    """
    from dflash_core.pipeline_file import load_pipeline
    from dflash_core.plugins import PluginManager
    from dflash_core.runner import Runner

    def run(yaml_text: str, *, plugins: tuple[Any, ...] = (), overrides: tuple[str, ...] = (),
            only: str | None = None, autoload: bool = True) -> PipelineRun:
        text = textwrap.dedent(yaml_text)
        if "run_dir:" not in text:
            text = f"run_dir: {tmp_path / 'run'}\n" + text
        if "version:" not in text:
            text = "version: 1\n" + text
        path = tmp_path / "pipeline.yaml"
        path.write_text(text)
        pm = PluginManager(autoload=autoload)
        for i, plugin in enumerate(plugins):
            pm.add_plugin(plugin, getattr(plugin, "__name__", f"plugin{i}"))
        pipeline = load_pipeline(str(path), pm, overrides=list(overrides))
        results = Runner(pipeline, pm, only=only).run()
        return PipelineRun(pipeline, results, Path(pipeline.run_dir))

    return run
