"""The shared retry loop: transient errors are retried with growing waits, permanent ones and the
last failure are raised, and a stop request ends the retries."""

from __future__ import annotations

import pytest

from dflash_core import retry
from dflash_core.retry import call_with_retries, is_permanent


class _ClientError(Exception):
    """Shaped like botocore's ClientError: the HTTP status is on ``response``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.fixture
def no_sleep(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", waits.append)
    return waits


def flaky(failures: list[BaseException]):
    calls = []

    def fn():
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return len(calls)

    return fn, calls


def test_transient_errors_are_retried_with_growing_waits(no_sleep):
    fn, calls = flaky([ConnectionError("reset"), _ClientError(503), TimeoutError()])
    seen = []
    assert call_with_retries(fn, retries=5, backoff=1.0, on_retry=lambda n, e, d: seen.append((n, type(e)))) == 4
    assert len(calls) == 4 and [n for n, _ in seen] == [1, 2, 3]
    for n, wait in enumerate(no_sleep, start=1):  # backoff * 2^(n-1) * [0.5, 1.5]
        assert 0.5 * 2 ** (n - 1) <= wait <= 1.5 * 2 ** (n - 1)


@pytest.mark.parametrize("exc", [FileNotFoundError("x"), PermissionError("x"), _ClientError(404), _ClientError(403)])
def test_permanent_errors_are_raised_at_once(no_sleep, exc):
    fn, calls = flaky([exc])
    with pytest.raises(type(exc)):
        call_with_retries(fn, retries=5, backoff=1.0)
    assert len(calls) == 1 and no_sleep == []


def test_the_last_failure_is_raised_and_stop_ends_early(no_sleep):
    fn, calls = flaky([OSError("a")] * 10)
    with pytest.raises(OSError):
        call_with_retries(fn, retries=2, backoff=0.1)
    assert len(calls) == 3
    fn, calls = flaky([OSError("a")] * 10)
    with pytest.raises(OSError):
        call_with_retries(fn, retries=5, backoff=0.1, stop=lambda: len(calls) >= 2)
    assert len(calls) == 2


def test_throttling_and_timeouts_are_not_permanent():
    assert not is_permanent(_ClientError(429)) and not is_permanent(_ClientError(408))
    assert not is_permanent(_ClientError(500)) and is_permanent(_ClientError(400))
    wrapped = OSError("wrapped")
    wrapped.__cause__ = _ClientError(404)
    assert is_permanent(wrapped)
