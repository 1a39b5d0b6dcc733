"""Where a relative path in a pipeline file points: the directory of the pipeline file.

So a pipeline runs the same from any working directory. A path given with ``--set`` is typed on
the command line and resolves against the current directory, like any other argument. URLs
(``s3://…``, ``file://…``) and ``~/…`` are kept as written. Stage params opt in with
``field(metadata={"path": True})`` (a ``str``, or a list of them); names that may be a hub name
as well as a path (``model``, ``tokenizer``) do not, and are read as transformers reads them.
"""

from __future__ import annotations

import dataclasses
import os

PATH_FIELD = {"path": True}
"""``metadata`` of a Config field that holds a local path or URL."""


def path_fields(config_cls: type) -> list[str]:
    """Names of ``config_cls``'s fields marked with :data:`PATH_FIELD`."""
    if not dataclasses.is_dataclass(config_cls):
        return []
    return [f.name for f in dataclasses.fields(config_cls) if f.metadata.get("path")]


def resolve_path(value: str, base: str) -> str:
    """``value`` made absolute against ``base`` unless it is a URL, ``~/…`` or absolute."""
    if "://" in value or value.startswith("~") or os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(base, value))
