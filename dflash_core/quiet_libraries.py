"""Keeps libraries from drawing over the live progress table.

Their own progress bars (transformers' GGUF and weight-loading bars, huggingface_hub's, and
tqdm's in stage processes spawned meanwhile) are switched off, and log handlers that write to the
terminal are pointed at the current ``sys.stdout``/``sys.stderr`` — which rich's live display has
redirected, so a log line is printed above the table instead of through it (a spawned stage's
records come to this process and print here too). What was switched is put back on exit (a library
first imported inside keeps its bars off: the process is a run that shows the table).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable, Iterator

BAR_SWITCHES = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
"""Read when a library is imported (or a bar is made), here and in spawned stage processes."""


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside: no library progress bars, terminal log lines go through ``sys.stdout/stderr``."""
    saved_env = {k: os.environ.get(k) for k in BAR_SWITCHES}
    os.environ.update(BAR_SWITCHES)
    turn_back_on = _bars_off()
    handlers = _terminal_handlers()
    for handler, stream in handlers:
        handler.setStream(sys.stderr if stream is sys.__stderr__ else sys.stdout)
    try:
        yield
    finally:
        for handler, stream in handlers:
            handler.setStream(stream)
        for switch in turn_back_on:
            switch()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bars_off() -> list[Callable[[], None]]:
    """Switch off the bars of libraries imported already (the others read ``BAR_SWITCHES``);
    returns what turns back on those that were on."""
    back: list[Callable[[], None]] = []
    if "huggingface_hub" in sys.modules:  # transformers, imported later, asks it
        import huggingface_hub.utils as hub

        if not hub.are_progress_bars_disabled():
            hub.disable_progress_bars()
            back.append(hub.enable_progress_bars)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            back.append(hf_logging.enable_progress_bar)
    return back


def _terminal_handlers() -> list[tuple[logging.StreamHandler, object]]:
    """Stream handlers (of any logger) that write straight to the process's terminal streams."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [(h, h.stream) for lg in loggers for h in lg.handlers
            if type(h) is logging.StreamHandler and h.stream in (sys.__stderr__, sys.__stdout__)]
