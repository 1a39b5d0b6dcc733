"""What every command shares: loading plugins and the pipeline file, and exit codes."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rich.console import Console

from dflash_core.plugins import PluginManager

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2, 4
# markup off: stage names, impls and error texts contain brackets ("[thread]", "[Errno 2]")
console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)


def plugin_manager(args: argparse.Namespace) -> PluginManager:
    """Plugins from entry points (unless disabled) plus ``-p module`` the user names;
    ``-p no:NAME`` disables the plugin NAME. The manager that built the command line (it collected
    the plugins' commands) is handed on in ``args``, so plugins load once per command."""
    loaded = getattr(args, "loaded_plugins", None)
    if loaded is not None:
        return loaded
    specs = getattr(args, "plugin", None) or []
    disabled = [s[3:] for s in specs if s.startswith("no:")]
    extra = [s for s in specs if not s.startswith("no:")]
    return PluginManager(disabled=disabled, extra_plugins=extra)


def load(args: argparse.Namespace, check_devices: bool = False) -> tuple[PluginManager, Any]:
    """Plugins and the validated pipeline; raises PipelineFileError on a bad file. Only ``run``
    needs this host to have the stages' devices (``check_devices``): the other commands inspect a
    job that may run elsewhere."""
    from dflash_core.pipeline_file import load_pipeline

    pm = plugin_manager(args)
    pipeline = load_pipeline(args.pipeline, pm, overrides=getattr(args, "set", None) or [],
                             check_devices=check_devices)
    return pm, pipeline


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", help="pipeline YAML file")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE",
                        help="override a value of the file, e.g. stages.train.params.lr=3e-4")


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
