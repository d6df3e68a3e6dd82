"""``has_event_loop``, as tensorrt_llm/executor/utils.py defines it: whether the *calling thread* runs an
asyncio loop right now (asyncio.get_running_loop succeeds), not whether some loop exists somewhere."""

from __future__ import annotations

import asyncio


def has_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
