"""Parsing of human-written quantities: durations ("30s", "2m", "500ms") and sizes ("80GiB").

Both parsers are pure and raise ValueError with the accepted forms, so the
config loader can show them next to the YAML path that held the bad value.
"""

from __future__ import annotations

import math
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


MAX_DURATION = 366 * 86400.0  # a year: longer than any job, timeout or interval makes sense
MAX_SIZE = 2**50  # 1 PiB: more than any node's memory or any checkpoint
_MAX_TEXT = 64  # characters of a quantity written as text; longer is not one of the forms


def _number(value: object, forms: str) -> float:
    """The number in a YAML value (int, float or the numeric part of a string), finite, or ValueError."""
    if isinstance(value, bool):  # YAML's true/false are not quantities
        raise ValueError(forms)
    if isinstance(value, int):
        if value.bit_length() > 64:  # before float(): a 5000-digit integer must not overflow or stall
            raise ValueError(f"a number below 2**64 (found an integer of {value.bit_length()} bits); {forms}")
        number = float(value)
    elif isinstance(value, float):
        number = value
    else:
        raise ValueError(forms)
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"a finite number (found {number!r}); {forms}")
    return number


def parse_duration(value: object) -> float:
    """Return seconds for 30, 2.5, "30s", "2m", "500ms", "1h"; ValueError (naming the forms) otherwise.
    Refused: booleans, NaN and infinities, negatives and more than a year (MAX_DURATION)."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value) if len(value) <= _MAX_TEXT else None
        if not match:
            raise ValueError(DURATION_FORMS)
        seconds = _number(float(match.group(1)), DURATION_FORMS) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        seconds = _number(value, DURATION_FORMS)
    if seconds < 0:
        raise ValueError("a duration of zero or more")
    if seconds > MAX_DURATION:
        raise ValueError(f"at most {MAX_DURATION:g} seconds (a year); found {seconds:g}")
    return seconds


def parse_size(value: object) -> int:
    """Return bytes for 1024, "512MiB", "80GiB", "64GB"; ValueError otherwise.
    Refused: booleans, NaN and infinities, negatives and more than 1 PiB (MAX_SIZE)."""
    if isinstance(value, str):
        match = _SIZE_RE.match(value) if len(value) <= _MAX_TEXT else None
        if not match:
            raise ValueError(SIZE_FORMS)
        size = _number(float(match.group(1)), SIZE_FORMS) * _SIZE_UNITS[(match.group(2) or "").lower()]
    else:
        size = _number(value, SIZE_FORMS)
    if size < 0:
        raise ValueError("a size of zero or more")
    if size > MAX_SIZE:
        raise ValueError(f"at most {MAX_SIZE} bytes (1 PiB); found {size:.4g}")
    return int(size)


def format_size(size: int) -> str:
    """Render bytes with a binary unit: 85899345920 -> "80.0 GiB"."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
