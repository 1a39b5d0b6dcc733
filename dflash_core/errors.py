"""Errors a user can fix by editing a pipeline file (or a ``--set``), shown like a compiler's.

A :class:`PipelineFileError` carries every problem found in one pass, so the user sees all of
them at once; the CLI prints :meth:`PipelineFileError.format` and exits with code 2, without a
traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

CONFIG_ERROR_EXIT_CODE = 2


@dataclass(frozen=True)
class ConfigError:
    """One problem at ``file:line:col`` (1-based), with the offending source line.

    ``file`` is the pipeline path as given, or ``--set`` for an override (then ``line`` is the
    1-based index of the override and ``source_line`` its text). ``help`` is what the value at
    fault means (a param's help), shown under the caret.
    """

    file: str
    line: int
    col: int
    message: str
    source_line: str = ""
    help: str = ""

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def format(self) -> str:
        """``file:line:col: message``, then the source line with a caret under the column, and
        the help of what is at fault."""
        head = f"{self.location}: {self.message}"
        if self.source_line.strip():
            src = self.source_line.rstrip("\r\n")
            # keep tabs so that the caret lines up with the source line however tabs are shown
            pad = "".join("\t" if ch == "\t" else " " for ch in src[: max(self.col - 1, 0)])
            head = f"{head}\n    {src}\n    {pad}^"
        return f"{head}\n    help: {self.help}" if self.help else head

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class PipelineFileError(Exception):
    """A pipeline file (or its overrides) is invalid; ``errors`` lists every problem found."""

    exit_code = CONFIG_ERROR_EXIT_CODE

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        self.errors: list[ConfigError] = list(errors)
        super().__init__(self.summary())

    def summary(self) -> str:
        n = len(self.errors)
        first = f": {self.errors[0]}" if self.errors else ""
        more = f" (and {n - 1} more)" if n > 1 else ""
        return f"{n} error{'s' if n != 1 else ''} in pipeline file{first}{more}"

    def format(self) -> str:
        """All errors, each with its source line and caret, then a count line."""
        n = len(self.errors)
        body = "\n".join(e.format() for e in self.errors)
        return f"{body}\n{n} error{'s' if n != 1 else ''}"

    def __str__(self) -> str:
        return self.format()
