"""``dflash-pipe list-stages``: every stage implementation, who provides it, and its params."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from dflash_core.cli.common import EXIT_OK, console, plugin_manager


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("list-stages", parents=[common], help="list stage implementations")
    p.add_argument("kind", nargs="?", help="only this kind")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_core.config_types import config_schema

    pm = plugin_manager(args)
    table = Table(title="stage implementations")
    for col in ("uses", "plugin", "inputs", "link", "params"):
        table.add_column(col)
    for (kind, name), cls in pm.registry.items():
        if args.kind and kind != args.kind:
            continue
        params = ", ".join(f"{f[0]}: {f[1]} = {f[2]!r}" if len(f) > 2 else str(f[0])
                           for f in config_schema(cls.Config))
        table.add_row(f"{kind}:{name}", pm.registry.owner(kind, name),
                      ", ".join(cls.inputs) or "-", cls.default_link, params)
    console.print(table)
    failed = pm.failed_plugins()
    if failed:
        console.print(f"{len(failed)} plugin(s) failed to load: see 'dflash-pipe plugins'")
    return EXIT_OK
