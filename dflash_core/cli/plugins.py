"""``dflash-pipe plugins``: what was loaded from where, and what failed and why."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from dflash_core.cli.common import EXIT_OK, console, plugin_manager


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plugins", parents=[common], help="list plugins and their status")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    pm = plugin_manager(args)
    table = Table(title="plugins")
    for col in ("name", "module", "distribution", "status", "stages / error"):
        table.add_column(col)
    for info in pm.plugins:
        dist = f"{info.dist} {info.version}".strip() or "-"
        detail = info.error if info.status == "failed" else ", ".join(info.stages) or "-"
        table.add_row(info.name, info.module, dist, info.status, detail)
    console.print(table)
    return EXIT_OK
