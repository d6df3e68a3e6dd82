"""Polling for a condition in process tests: the one wait loop the tests share."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """predicate()'s first truthy value within timeout seconds, polled every interval; else AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
