"""One retry loop for remote I/O (downloads, checkpoint uploads): exponential backoff with jitter,
and errors that no retry can fix raised at once.

Object stores fail transiently (5xx, throttling, dropped connections) and permanently (missing
object, bad credentials, 4xx); retrying the second kind only delays the error the user must see.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
                    TypeError, KeyError, AttributeError, NotImplementedError, ImportError)
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ParamValidationError",
                    "InvalidS3AddressingStyleError")


def http_status(exc: BaseException) -> int | None:
    """HTTP status of a botocore ClientError found on ``exc`` or its causes."""
    e: BaseException | None = exc
    for _ in range(5):
        if e is None:
            break
        resp = getattr(e, "response", None)
        if isinstance(resp, Mapping):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        e = e.__cause__ or e.__context__
    return None


def is_permanent(exc: BaseException) -> bool:
    """True for errors a retry cannot fix: missing or forbidden objects, bad arguments, missing
    credentials, HTTP 4xx other than 408 (timeout) and 429 (throttled)."""
    if isinstance(exc, _PERMANENT_TYPES) or type(exc).__name__ in _PERMANENT_NAMES:
        return True
    status = http_status(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def call_with_retries(fn: Callable[[], T], *, retries: int, backoff: float,
                      permanent: Callable[[BaseException], bool] = is_permanent,
                      stop: Callable[[], bool] | None = None,
                      on_retry: Callable[[int, BaseException, float], None] | None = None,
                      max_delay: float = 60.0,
                      wait_at_least: Callable[[BaseException], float | None] | None = None) -> T:
    """``fn()``, retried up to ``retries`` times after the first attempt. The n-th retry waits
    ``backoff · 2^(n-1)`` seconds ×0.5–1.5 (jitter keeps parallel workers from retrying in step),
    at most ``max_delay``. Permanent errors, the last failure, or any failure once ``stop()`` is
    true are raised. ``on_retry(n, error, delay)`` is called before each wait (logs, counters).
    ``wait_at_least(error)``: the least wait the failure asks for (an HTTP ``Retry-After``), or None."""
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified by ``permanent``
            if permanent(exc) or attempt >= retries or (stop is not None and stop()):
                raise
            attempt += 1
            delay = min(max_delay, backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            asked = wait_at_least(exc) if wait_at_least is not None else None
            if asked is not None:
                delay = max(delay, asked)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            time.sleep(delay)
