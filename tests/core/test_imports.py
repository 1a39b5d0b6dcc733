"""The engine imports without torch: every module of ``dflash_core`` (the CLI included), imported in
a fresh interpreter, leaves ``torch`` and ``transformers`` unimported. Stages import them inside
their functions; an engine module that imported them at the top would slow every command down and
tie the engine to one ML stack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO, cli_env

HEAVY = ("torch", "transformers")


def test_every_dflash_core_module_imports_without_torch():
    script = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys
        import dflash_core
        names = ["dflash_core"] + [m.name for m in pkgutil.walk_packages(dflash_core.__path__, "dflash_core.")]
        heavy_after = {{}}
        for name in names:
            importlib.import_module(name)
            for module in {HEAVY!r}:
                if module in sys.modules and module not in heavy_after:
                    heavy_after[module] = name
        print("RESULT " + json.dumps({{"modules": names, "heavy_after": heavy_after}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=cli_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    # the walk really covered the package, the CLI's modules included
    assert {"dflash_core.runner", "dflash_core.pipeline_file", "dflash_core.cli.main",
            "dflash_core.cli.run"} <= set(result["modules"]), result["modules"]
    assert result["heavy_after"] == {}, (
        f"imported by (the first module after which it was loaded): {result['heavy_after']}")
