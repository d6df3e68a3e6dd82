"""A deterministic corpus of mutated site files for `exaserve config check` (tests/config/test_config_fuzz.py).

    python -m tests.config.fuzz_corpus OUT_DIR [--count N] [--seed S]

Each file is one of the shipped site configs (site-configs/*.yaml) changed by one to three mutations, at
the data level (a value replaced by a hostile one: infinities, NaN, zero and negative durations, booleans
for numbers, 5000-digit integers, absurd sizes, hostlists of billions of names, huge strings, deep lists;
a key removed, added or duplicated) or at the text level (an alias bomb, 20k-deep nesting, bytes that
are not UTF-8, a truncation, random bytes). The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261130

HOSTILE_VALUES: list[Any] = [
    float("inf"), float("-inf"), float("nan"), 0, -1, -0.0, 1e308, True, False, None, "", [], {},
    2**64, -(2**70), 10**30, "0s", "-5s", "1e999", "nan", "inf", ".inf", "999999999999999999999TiB", "1 PiB",
    "2PiB", "0.0001ms", "n[1-9999999999]", "n[0-4294967296]", "n[1-4", "n]1[", "x" * 5000, "\u2028\x00",
    "\ud800", [[[[[[]]]]]], {"a": {"b": {"c": {}}}}, ["n[1-99999999999999999999]"], "9" * 300, 3.5, "30s",
    "80GiB", "all", "pmix", 1, 4096, 4097, 65536,
]

TEXT_MUTATIONS = ("alias_bomb", "deep_nesting", "not_utf8", "truncate", "random_bytes", "huge_int", "tabs",
                  "duplicate_key", "deep_mapping", "recursive_alias")


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in the document (containers included)."""
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, prefix + (i,))
    return out


def _set(data: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


def _delete(data: Any, path: tuple) -> None:
    for part in path[:-1]:
        data = data[part]
    del data[path[-1]]


def mutate_data(data: dict, rng: random.Random) -> dict:
    data = copy.deepcopy(data)
    paths = _paths(data)
    if not paths:
        return data
    path = rng.choice(paths)
    kind = rng.random()
    if kind < 0.7:
        _set(data, path, copy.deepcopy(rng.choice(HOSTILE_VALUES)))
    elif kind < 0.8 and len(path) > 0:
        _delete(data, path)
    elif kind < 0.9:
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        if isinstance(parent, dict):
            parent[rng.choice(["unknown_key", "nodes", "models", "interval", "1", "true"])] = rng.choice(HOSTILE_VALUES)
    else:
        models = data.get("models")
        if isinstance(models, list) and models:
            models.append(copy.deepcopy(models[0]))  # a duplicate model name
    return data


def mutate_text(text: bytes, rng: random.Random, kind: str) -> bytes:
    if kind == "alias_bomb":
        lines = [b'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
        lines += [b"a%d: &a%d [%s]" % (i, i, b",".join([b"*a%d" % (i - 1)] * 9)) for i in range(1, 9)]
        key = rng.choice([b"models", b"description", b"quota_groups", b"cluster"])
        return text + b"\n" + b"\n".join(lines) + b"\n" + key + b": *a8\n"
    if kind == "deep_nesting":
        depth = rng.choice([100, 1000, 20000])
        return text + b"\nextra: " + b"[" * depth + b"]" * depth + b"\n"
    if kind == "deep_mapping":
        depth = rng.choice([40, 500])
        return text + b"\n" + b"".join(b"  " * i + b"k%d:\n" % i for i in range(depth)) + b"  " * depth + b"v\n"
    if kind == "not_utf8":
        cut = rng.randrange(len(text))
        return text[:cut] + bytes([rng.choice([0xff, 0xfe, 0xc0, 0x80, 0xed])]) + text[cut:]
    if kind == "truncate":
        return text[:rng.randrange(len(text))]
    if kind == "random_bytes":
        cut = rng.randrange(len(text))
        return text[:cut] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16))) + text[cut:]
    if kind == "huge_int":
        return text + b"\nscheduler_extra: " + b"7" * rng.choice([50, 5000, 100000]) + b"\n"
    if kind == "tabs":
        return text.replace(b"  ", b"\t", 3)
    if kind == "duplicate_key":
        return text + b"\nsite: again\nsite: twice\n"
    if kind == "recursive_alias":
        return text + b"\nloop: &loop [*loop]\n"
    raise ValueError(kind)


def corpus(count: int = 300, seed: int = SEED) -> list[tuple[str, bytes]]:
    """(name, file contents) for `count` mutated site files; deterministic for a seed."""
    rng = random.Random(seed)
    sources = sorted((ROOT / "site-configs").glob("*.yaml"))
    texts = [(p.stem, p.read_bytes()) for p in sources]
    out = []
    for n in range(count):
        stem, text = texts[n % len(texts)]
        if rng.random() < 0.3:
            kind = rng.choice(TEXT_MUTATIONS)
            out.append((f"{n:04d}-{stem}-{kind}.yaml", mutate_text(text, rng, kind)))
            continue
        data = yaml.safe_load(text)
        for _ in range(rng.randint(1, 3)):
            data = mutate_data(data, rng)
        body = yaml.safe_dump(data, sort_keys=False, allow_unicode=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        out.append((f"{n:04d}-{stem}-data.yaml", body))
    return out


def write_corpus(directory: Path, count: int = 300, seed: int = SEED) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, body in corpus(count, seed):
        path = directory / name
        path.write_bytes(body)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(f"{len(write_corpus(args.out, args.count, args.seed))} files in {args.out}")


if __name__ == "__main__":
    main()
