"""Reading a site file within bounds: whatever it holds, `exaserve config check` answers in well under a
second, with exit 2 and a place in the file, never a traceback or a hang.

- the file: at most MAX_FILE_BYTES (256 KiB), UTF-8 (the byte offset of the first bad byte named otherwise);
- YAML: at most MAX_DEPTH levels of nesting (checked while composing, before PyYAML's recursion could
  overflow), at most MAX_NODES values once every alias is expanded (an alias bomb of a few hundred bytes
  expands to billions: counted on the composed graph, each shared node once, never expanded), integers
  of at most MAX_INT_DIGITS digits (Python refuses to parse longer ones anyway, with a ValueError);
- the parsed document: integers beyond 64 bits are refused with their YAML path (no setting needs them,
  and some fields have no upper bound of their own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_FILE_BYTES = 256 << 10  # a site file is a few KiB; pure-Python YAML reads 256 KiB in about 2 s
MAX_DEPTH = 32  # the deepest setting is four levels down
MAX_NODES = 100_000  # values after alias expansion
MAX_INT_DIGITS = 40


class ConfigFileError(Exception):
    def __init__(self, where: str, found: str, allowed: str):
        super().__init__(f"{where}: found {found}; allowed: {allowed}")
        self.where, self.found, self.allowed = where, found, allowed


def read_config_text(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError("(file)", exc.strerror or str(exc), "a readable YAML file") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigFileError("(file)", f"more than {MAX_FILE_BYTES} bytes", f"a site file of at most {MAX_FILE_BYTES} "
                                                                              "bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigFileError(f"line {line} (byte {exc.start})", f"byte 0x{data[exc.start]:02x}, not UTF-8",
                              "a UTF-8 text file") from exc


def _where(node: Node) -> str:
    mark = node.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the nesting depth and integer length bounded."""

    _depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 (PyYAML's signature)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                event = self.peek_event()
                raise ConfigFileError(f"line {event.start_mark.line + 1}, column {event.start_mark.column + 1}",
                                      f"nesting deeper than {MAX_DEPTH} levels", f"at most {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):  # noqa: ANN001
        digits = sum(ch.isalnum() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise ConfigFileError(_where(node), f"an integer of {digits} digits",
                                  f"an integer of at most {MAX_INT_DIGITS} digits")
        return super().construct_yaml_int(node)


    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        """A key given twice in one mapping is an error (YAML keeps the last one silently: a site file whose
        second `models:` or `port:` quietly replaced the first would run a config nobody wrote)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                if key is None or key == "<<":
                    continue
                if key in seen:
                    raise ConfigFileError(_where(key_node), f"the key {key!r} a second time in one mapping (first "
                                          f"at line {seen[key]})", "each key once per mapping")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def expanded_size(root: Node, limit: int = MAX_NODES) -> int:
    """Values in the document once every alias is expanded, counting each shared node's size once (memo),
    so a bomb is measured in linear time; stops counting past `limit`."""
    sizes: dict[int, int] = {}

    def size(node: Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        sizes[key] = limit + 1  # a node inside itself (a recursive alias) is refused as too big
        total = 1
        if isinstance(node, SequenceNode):
            for child in node.value:
                total += size(child)
                if total > limit:
                    break
        elif isinstance(node, MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > limit:
                    break
        sizes[key] = min(total, limit + 1)
        return sizes[key]

    return size(root)


def load_yaml(text: str) -> Any:
    """One YAML document, bounded (module docstring); ConfigFileError or yaml.YAMLError otherwise."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > MAX_NODES:
            raise ConfigFileError(_where(node), f"more than {MAX_NODES} values once aliases are expanded",
                                  f"at most {MAX_NODES} values (anchors and aliases count each time used)")
        return loader.construct_document(node)
    except (RecursionError, ValueError, OverflowError) as exc:  # bounded above; a last guard, with a place
        raise ConfigFileError("(file)", f"{type(exc).__name__}: {str(exc)[:120]}", "a plain site file") from exc
    finally:
        loader.dispose()


def oversized_numbers(data: Any, loc: tuple = ()) -> list[tuple[tuple, str, str]]:
    """(YAML location, found, allowed) for every integer beyond 64 bits (depth bounded by MAX_DEPTH)."""
    found = []
    if isinstance(data, bool):
        return found
    if isinstance(data, int) and data.bit_length() > 63:
        found.append((loc, f"an integer of {len(str(abs(data)))} digits", f"an integer of at most {2**63 - 1}"))
    elif isinstance(data, dict):
        for key, value in data.items():
            found += oversized_numbers(value, loc + (str(key)[:60],))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += oversized_numbers(value, loc + (index,))
    return found[:50]
