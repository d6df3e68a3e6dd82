"""API keys of quota groups, stored hashed.

A key is a random string handed to a group once (`exaserve keys add GROUP`); the site keeps only its
SHA-256 (``sha256:<hex>``), in the site YAML (``quota_groups[].api_key_hashes``) or in a key file of
the group's (``quota_groups[].key_file``, one hash a line, mode 0600). Keys are 256-bit random, so an
unsalted hash is enough: nothing can be guessed from it. Plaintext ``api_keys`` still work (older
site files) and are warned about.

Lookup compares the caller's hash with every stored one by ``hmac.compare_digest`` and never stops
early, so the time taken says nothing about which key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Optional

PREFIX = "sha256:"
HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"
_HASH = re.compile(HASH_PATTERN)
KEY_PREFIX = "exa-"


class KeyFileError(Exception):
    """A group's key file that cannot be used (missing, readable by others, malformed)."""


def hash_key(key: str) -> str:
    return PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_file_path(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser()


def read_key_file(path: Path, group: str) -> list[str]:
    """The hashes in a group's key file; refused when others may read or write it, or a line is no hash."""
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"quota group {group!r}: cannot read its key_file {path}: {exc.strerror}; create it "
                           f"with `exaserve keys add {group}`") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise KeyFileError(f"quota group {group!r}: key_file {path} has mode {stat.S_IMODE(info.st_mode):o}; "
                           "it must be readable by its owner only: chmod 600 it")
    hashes = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _HASH.match(line):
            # The line itself is not echoed: it may be a plaintext key put there by mistake.
            raise KeyFileError(f"quota group {group!r}: key_file {path} line {number} is not a key hash "
                               "(sha256: and 64 hex digits, as `exaserve keys add` writes)")
        hashes.append(line)
    return hashes


def append_key_hash(path: Path, digest: str) -> None:
    """Add one hash to a key file, made 0600 if new; durable before the key is shown."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (digest + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class KeyRing:
    """Which quota group, if any, a presented key belongs to."""

    def __init__(self, entries: list[tuple[str, str]]):
        self._entries = [(digest.encode(), group) for digest, group in entries]  # (hash, group)

    @classmethod
    def from_site(cls, site) -> "KeyRing":
        entries = []
        for group in site.quota_groups:
            hashes = list(group.api_key_hashes) + [hash_key(k) for k in group.api_keys]
            if group.key_file:
                hashes += read_key_file(key_file_path(group.key_file), group.name)
            entries += [(h, group.name) for h in hashes]
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def group_of(self, key: str) -> Optional[str]:
        if not key:
            return None
        digest = hash_key(key).encode()
        found = None
        for stored, group in self._entries:  # every entry, no early exit
            if hmac.compare_digest(digest, stored) and found is None:
                found = group
        return found


def plaintext_warnings(site) -> list[str]:
    return [f"quota_groups[{i}].api_keys: group {g.name!r} keeps {len(g.api_keys)} key(s) in plaintext; "
            f"store hashes instead (`exaserve keys add {g.name}`, or api_key_hashes: [sha256 of each key])"
            for i, g in enumerate(site.quota_groups) if g.api_keys]


def key_file_problems(site) -> list[str]:
    """Why each quota group's key_file cannot be used (missing, open to others, malformed); [] when all can.
    `exaserve serve`, rank 0 and `config check` ask before anything is created, so a bad file is one line."""
    problems = []
    for group in site.quota_groups:
        if group.key_file:
            try:
                read_key_file(key_file_path(group.key_file), group.name)
            except KeyFileError as exc:
                problems.append(str(exc))
    return problems
