"""Slurm hostlist expressions: "n[1-4]", "gpu[001-003,007],login1".

Pure functions, the same grammar `scontrol show hostnames` accepts for the
forms a site config uses: comma-separated items, each a prefix with at most
one bracketed range list (zero padding kept), optionally followed by a suffix.
"""

from __future__ import annotations

import re

_ITEM_RE = re.compile(r"^([^\[\],]*)\[([^\]]+)\](.*)$")
MAX_HOSTS = 65536  # names one expression may expand to (a site has at most a few thousand nodes)
MAX_DIGITS = 12  # digits of one range bound
_SHOWN = 60  # characters of an expression quoted in an error


def _show(text: str) -> str:
    """The expression as an error quotes it: bounded, so a megabyte of hostlist is not copied into a message."""
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "...")


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {_show(expr)}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {_show(expr)}")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def expand_hostlist(expr: str, max_hosts: int = MAX_HOSTS) -> list[str]:
    """"n[1-3],x" -> ["n1", "n2", "n3", "x"]; ValueError naming the bad part. The count is checked before
    anything is expanded: more than `max_hosts` names (e.g. "n[1-9999999999]") is refused at once."""
    if not isinstance(expr, str):
        raise ValueError(f"a hostlist string such as \"n[1-4]\", not {type(expr).__name__}")
    items = []
    total = 0
    for item in _split_top_level(expr):
        match = _ITEM_RE.match(item)
        if not match:
            if "[" in item or "]" in item:
                raise ValueError(f"bad hostlist item {_show(item)} in {_show(expr)}")
            items.append((item, None, "", ()))
            total += 1
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            raise ValueError(f"only one bracket group per item is supported: {_show(item)}")
        parts = []
        for part in ranges.split(","):
            bounds = part.strip().split("-")
            if len(bounds) not in (1, 2) or not all(b.isdigit() and b.isascii() for b in bounds):
                raise ValueError(f"bad range {_show(part)} in hostlist {_show(expr)}; use forms like 1-4 or 007")
            if any(len(b) > MAX_DIGITS for b in bounds):
                raise ValueError(f"range {_show(part)} in hostlist {_show(expr)}: at most {MAX_DIGITS} digits a bound")
            lo, hi = int(bounds[0]), int(bounds[-1])
            if hi < lo:
                raise ValueError(f"range {_show(part)} runs backwards in {_show(expr)}")
            total += hi - lo + 1
            parts.append((lo, hi, len(bounds[0]) if bounds[0].startswith("0") else 0))
        items.append((prefix, ranges, suffix, parts))
        if total > max_hosts:
            raise ValueError(f"hostlist {_show(expr)} names more than {max_hosts} hosts (at most {max_hosts})")
    hosts: list[str] = []
    for prefix, ranges, suffix, parts in items:
        if ranges is None:
            hosts.append(prefix)
            continue
        for lo, hi, width in parts:
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(lo, hi + 1))
    return hosts


def compress_hostlist(hosts: list[str]) -> str:
    """Inverse of expand_hostlist for prefix+number names: ["n1","n2","n4"] -> "n[1-2,4]"."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    order: list[tuple[str, int]] = []
    for host in hosts:
        match = re.match(r"^(.*?)(\d+)$", host)
        if not match:
            plain.append(host)
            continue
        prefix, digits = match.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        key = (prefix, width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    parts: list[str] = []
    for prefix, width in order:
        numbers = sorted(set(groups[(prefix, width)]))
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        ranges, start, prev = [], numbers[0], numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts + plain)
