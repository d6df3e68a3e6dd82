"""Slurm hostlist expressions: "n[1-4]", "gpu[001-003,007],login1".

Pure functions, the same grammar `scontrol show hostnames` accepts for the
forms a site config uses: comma-separated items, each a prefix with at most
one bracketed range list (zero padding kept), optionally followed by a suffix.
"""

from __future__ import annotations

import re

_ITEM_RE = re.compile(r"^([^\[\],]*)\[([^\]]+)\](.*)$")


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def expand_hostlist(expr: str) -> list[str]:
    """"n[1-3],x" -> ["n1", "n2", "n3", "x"]; ValueError naming the bad part."""
    hosts: list[str] = []
    for item in _split_top_level(expr):
        match = _ITEM_RE.match(item)
        if not match:
            if "[" in item or "]" in item:
                raise ValueError(f"bad hostlist item {item!r} in {expr!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            raise ValueError(f"only one bracket group per item is supported: {item!r}")
        for part in ranges.split(","):
            bounds = part.strip().split("-")
            if len(bounds) == 1 and bounds[0].isdigit():
                hosts.append(f"{prefix}{bounds[0]}{suffix}")
            elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
                lo, hi = int(bounds[0]), int(bounds[1])
                if hi < lo:
                    raise ValueError(f"range {part!r} runs backwards in {expr!r}")
                width = len(bounds[0]) if bounds[0].startswith("0") else 0
                hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(lo, hi + 1))
            else:
                raise ValueError(f"bad range {part!r} in hostlist {expr!r}; use forms like 1-4 or 007")
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
