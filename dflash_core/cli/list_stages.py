"""``dflash-pipe list-stages``: every stage implementation, who provides it, and its params."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from dflash_core.cli.common import EXIT_CONFIG, EXIT_OK, console, err_console, plugin_manager


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("list-stages", parents=[common], help="list stage implementations",
                       description="Stage implementations and their params; with -v, each "
                                   "param's type, default and help.")
    p.add_argument("kind", nargs="?", help="only this kind")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_core.config_types import config_schema, did_you_mean

    pm = plugin_manager(args)
    kinds = pm.registry.kinds()
    if args.kind and args.kind not in kinds:
        err_console.print(f"error: unknown kind '{args.kind}'{did_you_mean(args.kind, kinds)}; "
                          f"kinds: {', '.join(kinds) or 'none'}")
        return EXIT_CONFIG
    chosen = [(key, cls) for key, cls in pm.registry.items() if not args.kind or key[0] == args.kind]
    rows = [(":".join(key), pm.registry.owner(*key), _ports(cls), f"{cls.output.name}s" if cls.output else "-",
             cls.default_link, ", ".join(f"{f[0]}: {f[1]} = {f[2]!r}" if len(f) > 2 else str(f[0])
                                         for f in config_schema(cls.Config)))
            for key, cls in chosen]
    table = Table(title="stage implementations")
    # the uses column is what people type into a pipeline file: never cut, the others wrap
    table.add_column("uses", no_wrap=True, min_width=max((len(r[0]) for r in rows), default=4))
    for col in ("plugin", "inputs", "output", "link", "params"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if args.verbose:
        for key, cls in chosen:
            console.print(params_table(":".join(key), cls.Config))
    failed = pm.failed_plugins()
    if failed:
        console.print(f"{len(failed)} plugin(s) failed to load: see 'dflash-pipe plugins'")
    return EXIT_OK


def params_table(uses: str, config_cls: type) -> Table:
    """One implementation's params: name, type, default and help."""
    from dflash_core.config_types import config_schema

    table = Table(title=f"{uses} params")
    table.add_column("param", no_wrap=True)
    for col in ("type", "default", "help"):
        table.add_column(col)
    for row in config_schema(config_cls, nested=True):
        table.add_row(row.name, row.type, repr(row.default), row.doc)
    return table


def _ports(cls: type) -> str:
    """Each input port with the item types it takes (an untyped port: its name alone)."""
    from dflash_core.items import describe, port_types

    return ", ".join(f"{port}: {describe(types)}" if types else port
                     for port, types in port_types(cls).items()) or "-"
