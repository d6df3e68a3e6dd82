"""Parsing of human-written quantities: durations ("30s", "2m", "500ms") and sizes ("80GiB").

Both parsers are pure and raise ValueError with the accepted forms, so the
config loader can show them next to the YAML path that held the bad value.
"""

from __future__ import annotations

import re

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)

DURATION_FORMS = 'a number of seconds or a string such as "500ms", "30s", "2m", "1h"'
SIZE_FORMS = 'a number of bytes or a string such as "512MiB", "80GiB", "64GB"'


def parse_duration(value: object) -> float:
    """Return seconds for 30, 2.5, "30s", "2m", "500ms", "1h"; ValueError (naming the forms) otherwise."""
    if isinstance(value, bool):
        raise ValueError(DURATION_FORMS)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if not match:
            raise ValueError(DURATION_FORMS)
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        raise ValueError(DURATION_FORMS)
    if seconds < 0:
        raise ValueError("a duration of zero or more")
    return seconds


def parse_size(value: object) -> int:
    """Return bytes for 1024, "512MiB", "80GiB", "64GB"; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(SIZE_FORMS)
    if isinstance(value, (int, float)):
        size = float(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(SIZE_FORMS)
        size = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    else:
        raise ValueError(SIZE_FORMS)
    if size < 0:
        raise ValueError("a size of zero or more")
    return int(size)


def format_size(size: int) -> str:
    """Render bytes with a binary unit: 85899345920 -> "80.0 GiB"."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
