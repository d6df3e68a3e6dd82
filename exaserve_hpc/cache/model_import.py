"""Import a Hugging Face checkpoint directory into the shared L3 model store (`exaserve model import`).

``import_model(src, store, name)`` checks that ``src`` is a Hugging Face model
directory exaserve can serve, then copies it to ``<store>/<name>`` with the
checksum manifest (``manifest.py``) that every weight tier verifies against:
L3 reads, L2 copies, prefetch and ``exaserve model verify``.

What ``src`` must hold:
- ``config.json`` whose ``model_type`` is one of ``SUPPORTED_MODEL_TYPES``;
- weights as ``model.safetensors``, or shards ``model-0000K-of-0000N.safetensors``
  with ``model.safetensors.index.json`` whose ``weight_map`` names exactly the
  shard files present. Every safetensors header is parsed (8-byte little-endian
  length, then JSON) and checked: well-formed, offsets inside the file, dtypes
  among ``SUPPORTED_DTYPES``, and the tensors the index names. Tensors are not
  loaded;
- ``tokenizer.json`` (a Hugging Face fast tokenizer; ``tokenizer.model`` alone,
  sentencepiece, is not supported).
Small metadata files (``*.json``, ``*.jinja``, ``*.txt``, ``*.md``, ``LICENSE*``:
tokenizer_config.json, chat_template.jinja, generation_config.json, ...) are
copied too. PyTorch pickles (``*.bin``, ``*.pt``, ``*.pth``) are refused: they
are never loaded, since unpickling can run code. Subdirectories (``original/``)
and other files are skipped, each reported through ``note``.

How it is written: into a temporary sibling ``<store>/.<name>.partial-*``
(0700, files 0600, as ``create_tiny_checkpoint`` writes), hashing each chunk as
it is copied (every source byte is read once; the digests of ``manifest.json``
come from that copy, so the destination is not read back), fsynced, then
renamed into place and the store fsynced. An existing ``<store>/<name>`` is
refused unless ``force``; then it is replaced atomically (``renameat2``
RENAME_EXCHANGE where the file system has it; elsewhere two renames, the old
copy moved aside first and put back if the second fails). An error or Ctrl-C
leaves no partial destination. Errors are ``CheckpointError`` naming the file
and the fix.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from exaserve_hpc.cache.checkpoint import CONFIG_FILE, SHARD_RE
from exaserve_hpc.cache.hf_format import HF_MODEL_TYPES, INDEX_FILE, SINGLE_FILE
from exaserve_hpc.cache.manifest import (
    ALL_DIGESTS, MANIFEST_FILE, MANIFEST_FORMAT, CheckpointError, Progress, fsync_dir, new_hash,
    parse_manifest, write_synced,
)

SUPPORTED_MODEL_TYPES = HF_MODEL_TYPES  # what the reference engine runs (hf_format.py)
SUPPORTED_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype code -> bytes per element
TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
METADATA_SUFFIXES = (".json", ".jinja", ".txt", ".md")
# A model name, optionally with the '@VERSION' a rollout names a version by (rollout_control.version_dir):
# each part as the site config's model_name / rollout's version name, so NAME is one safe path component.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}(@[A-Za-z0-9][A-Za-z0-9._-]{0,63})?")
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
CHUNK = 8 << 20
BUFFERS = 4  # chunks in flight between the reader and the hash/write threads
_LFS_POINTER = b"version https://git-lfs"

log = logging.getLogger("exaserve.checkpoint")
Note = Callable[[str], None]


@dataclass
class SourceFile:
    name: str
    size: int
    data: bytes | None = None  # read (and checked) while scanning: written from memory, not read again
    header: bytes | None = None  # a safetensors file's length + header, checked while scanning


@dataclass
class ImportPlan:
    """What ``scan_source`` found: the files to copy, in order, and the source's model_type."""

    src: Path
    model_type: str
    files: list[SourceFile] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


def check_name(name: str) -> str:
    """``name`` if it is a safe single path component for the store; CheckpointError otherwise."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise CheckpointError(
            f"model name {name!r} is not valid: use letters, digits, '.', '_' and '-', starting with a letter "
            "or digit, at most 64 characters, optionally followed by '@VERSION' (e.g. llama-3.1-8b or "
            "llama-3.1-8b@v2, how a rollout names a version); it is one directory name in the store, so no "
            "'/' and no '..'"
        )
    return name


# ---------------------------------------------------------------- checking the source


def scan_source(src: str | os.PathLike, note: Note | None = None) -> ImportPlan:
    """Check that ``src`` is a Hugging Face model directory exaserve can serve; the files to copy.

    Reads config.json, the index and tokenizer.json whole (kept for the copy) and the header of
    every safetensors file; raises CheckpointError naming the file and the fix.
    """
    note = note or log.warning
    root = Path(src).expanduser()
    if not root.is_dir():
        raise CheckpointError(
            f"{root} is not a directory; give a Hugging Face model directory (config.json, *.safetensors, "
            "tokenizer.json), e.g. a `huggingface-cli download MODEL --local-dir DIR` target or a snapshot "
            "under ~/.cache/huggingface/hub/models--*/snapshots/"
        )
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise CheckpointError(f"cannot list {root} ({e.strerror or e}); check the path and its permissions") from e
    weights, metadata, pickles, skipped = [], [], [], []
    sizes: dict[str, int] = {}
    for entry in entries:
        name = entry.name
        path = root / name
        try:
            if entry.is_dir():  # follows symbolic links, as everything here does (HF cache snapshots are links)
                skipped.append(f"{name}/ (a subdirectory)")
                continue
            if not entry.is_file():
                if entry.is_symlink():
                    raise CheckpointError(f"{path} is a broken symbolic link; re-download the model "
                                          "(or remove the link if the file is not needed)")
                skipped.append(f"{name} (not a regular file)")
                continue
            size = entry.stat().st_size
        except OSError as e:
            raise CheckpointError(f"cannot read {path} ({e.strerror or e}); check its permissions "
                                  "or re-download it") from e
        if name.endswith(PICKLE_SUFFIXES):
            pickles.append(name)
        elif name.endswith(".safetensors"):
            weights.append(name)
        elif name == MANIFEST_FILE:
            skipped.append(f"{name} (a new manifest is written for the copy)")
            continue
        elif name == SENTENCEPIECE_FILE:
            skipped.append(f"{name} (sentencepiece; exaserve reads tokenizer.json)")
            continue
        elif name.endswith(METADATA_SUFFIXES) or name.startswith("LICENSE"):
            metadata.append(name)
        else:
            skipped.append(name)
            continue
        sizes[name] = size
    names = set(sizes)

    if pickles:
        listed = ", ".join(pickles)
        fix = ("the directory also has safetensors weights: move the pickle files out of it (they would not be "
               "used) and import again" if weights else
               "convert them to safetensors first (e.g. transformers: AutoModelForCausalLM.from_pretrained(SRC)"
               ".save_pretrained(DIR, safe_serialization=True), on a machine where running the pickle is "
               "acceptable), or download the model's safetensors release")
        raise CheckpointError(f"{root}: {listed} {'is a' if len(pickles) == 1 else 'are'} PyTorch pickle "
                              f"file{'s' if len(pickles) > 1 else ''}, which exaserve does not load (unpickling "
                              f"can run arbitrary code); {fix}")
    if CONFIG_FILE not in names:
        raise CheckpointError(f"{root / CONFIG_FILE} is missing, so {root} is not a Hugging Face model "
                              "directory; download the model's config.json with its weights")
    config_data = _read_small(root / CONFIG_FILE)
    config = _parse_json(root / CONFIG_FILE, config_data, "re-download it from the model's repository")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{root / CONFIG_FILE}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Import a model of one of those families"
        )
    if TOKENIZER_FILE not in names:
        if SENTENCEPIECE_FILE in (e.name for e in entries):
            raise CheckpointError(
                f"{root / TOKENIZER_FILE} is missing: {root} has only {SENTENCEPIECE_FILE}, a sentencepiece "
                f"tokenizer, which exaserve does not support; write {TOKENIZER_FILE} (the Hugging Face fast "
                f"tokenizer) with transformers: AutoTokenizer.from_pretrained(SRC).save_pretrained(SRC), or "
                "download it from the model's repository"
            )
        raise CheckpointError(f"{root / TOKENIZER_FILE} is missing; download it from the model's repository "
                              "(exaserve needs the Hugging Face fast tokenizer)")
    tokenizer_data = _read_small(root / TOKENIZER_FILE)
    _parse_json(root / TOKENIZER_FILE, tokenizer_data, "re-download it from the model's repository")

    data = {CONFIG_FILE: config_data, TOKENIZER_FILE: tokenizer_data}
    shards, weight_map = _weight_files(root, weights, sizes, data)
    headers = {}
    seen: dict[str, str] = {}  # tensor -> the file that holds it
    for shard in shards:
        headers[shard], tensors = read_safetensors_header(root / shard, sizes[shard])
        for tensor in tensors:
            if tensor in seen:
                raise CheckpointError(f"{root / shard}: tensor {tensor!r} is also in {seen[tensor]}; the shards "
                                      "are from different exports. Re-download the model")
            seen[tensor] = shard
    if weight_map is not None:
        for tensor, shard in sorted(weight_map.items()):
            if seen.get(tensor) != shard:
                where = f"is in {seen[tensor]}" if tensor in seen else "is in no shard"
                raise CheckpointError(f"{root / INDEX_FILE} maps tensor {tensor!r} to {shard}, but it {where}; "
                                      "the index and the shards do not match. Re-download the model")
        unlisted = sorted(set(seen) - set(weight_map))
        if unlisted:
            raise CheckpointError(f"{root / seen[unlisted[0]]} holds tensor(s) {unlisted[:5]} that "
                                  f"{INDEX_FILE} does not list; the index and the shards do not match. "
                                  "Re-download the model")
    if skipped:
        note(f"{root}: skipped, not used by exaserve: {', '.join(skipped)}")

    plan = ImportPlan(root, model_type)
    for name in sorted(metadata):
        plan.files.append(SourceFile(name, len(data[name]) if name in data else sizes[name], data.get(name)))
    for name in shards:
        plan.files.append(SourceFile(name, sizes[name], header=headers[name]))
    return plan


def _read_small(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); check its permissions") from e


def _parse_json(path: Path, data: bytes, fix: str) -> dict:
    if data.startswith(_LFS_POINTER):
        raise CheckpointError(f"{path} is a Git LFS pointer, not the file; run `git lfs pull` in "
                              f"{path.parent} (or download with huggingface-cli)")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {fix}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object; {fix}")
    return value


def _weight_files(root: Path, present: list[str], sizes: dict[str, int],
                  data: dict[str, bytes]) -> tuple[list[str], dict[str, str] | None]:
    """(the weight files, in order; the index's weight_map or None for a single model.safetensors)."""
    expected = (f"expected {SINGLE_FILE}, or shards model-0000K-of-0000N.safetensors with {INDEX_FILE}")
    if INDEX_FILE not in sizes:
        if not present:
            raise CheckpointError(f"{root} has no safetensors weights; {expected}. Download the model's "
                                  "safetensors files")
        if present == [SINGLE_FILE]:
            return present, None
        if any(SHARD_RE.match(n) for n in present):
            raise CheckpointError(f"{root / INDEX_FILE} is missing, so the shards {present[:5]} cannot be "
                                  "loaded (it maps each tensor to its shard); download it from the model's "
                                  "repository")
        extra = [n for n in present if n != SINGLE_FILE]
        raise CheckpointError(f"{root}: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not "
                              f"{'a weight file' if len(extra) == 1 else 'weight files'} exaserve reads "
                              f"({expected}); move {'it' if len(extra) == 1 else 'them'} out of the directory")
    data[INDEX_FILE] = _read_small(root / INDEX_FILE)
    index = _parse_json(root / INDEX_FILE, data[INDEX_FILE], "re-download it from the model's repository")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{root / INDEX_FILE} has no weight_map of tensor names to shard files; "
                              "re-download it from the model's repository")
    listed = sorted(set(weight_map.values()))
    bad = [n for n in listed if "/" in n or "\\" in n or n in (".", "..") or not n.endswith(".safetensors")]
    if bad:
        raise CheckpointError(f"{root / INDEX_FILE} names {bad[:3]} as shards; shards are .safetensors files "
                              "in the model directory itself. Re-download the index")
    missing = [n for n in listed if n not in sizes]
    if missing:
        raise CheckpointError(f"{root}: shard(s) {', '.join(missing)} listed in {INDEX_FILE} "
                              f"{'is' if len(missing) == 1 else 'are'} missing; the download is incomplete. "
                              "Download the missing shard(s) and import again")
    extra = sorted(set(present) - set(listed))
    if extra:
        raise CheckpointError(f"{root}: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not listed in "
                              f"{INDEX_FILE}, so exaserve would not know {'its' if len(extra) == 1 else 'their'} "
                              "tensors (another export or a stale file, e.g. Mistral's consolidated.safetensors); "
                              f"move {'it' if len(extra) == 1 else 'them'} out of the directory")
    numbered = [SHARD_RE.match(n) for n in listed]
    if all(numbered):
        counts = {int(m.group(2)) for m in numbered}
        count = max(counts)
        want = [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        if len(counts) > 1 or listed != want:
            gaps = [w for w in want if w not in listed]
            raise CheckpointError(f"{root}: the shard set is incomplete: expected {count} shards, missing "
                                  f"{', '.join(gaps) or 'none'}, found {', '.join(listed)}; re-download the model")
    return listed, weight_map


def read_safetensors_header(path: str | os.PathLike, size: int | None = None) -> tuple[bytes, dict[str, dict]]:
    """(the file's first 8 + N bytes, its tensors: name -> {dtype, shape, data_offsets}); tensors not read.

    CheckpointError unless the header is well-formed, every dtype is in SUPPORTED_DTYPES, every
    tensor's bytes lie inside the file and match its shape, and the tensors fill the data exactly.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size if size is None else size
            prefix = f.read(8)
            if prefix == _LFS_POINTER[:8] and f.read(len(_LFS_POINTER) - 8) == _LFS_POINTER[8:]:
                raise CheckpointError(f"{path} is a Git LFS pointer, not the weights; run `git lfs pull` in "
                                      f"{path.parent} (or download with huggingface-cli)")
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors file; it is truncated. "
                                      "Re-download it")
            (length,) = struct.unpack("<Q", prefix)
            if length < 2 or length > MAX_HEADER or 8 + length > size:
                raise CheckpointError(f"{path} is not a valid safetensors file: its header length {length} does not "
                                      f"fit a {size}-byte file (at most {MAX_HEADER}); it is truncated or not "
                                      "safetensors. Re-download it")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); check its permissions") from e
    if len(raw) != length:
        raise CheckpointError(f"{path} ended inside its header; it is truncated. Re-download it")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file (header: {e}); re-download it") from e
    data_len = size - 8 - length
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_problem(info, data_len)
        if problem == "dtype":
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: {', '.join(SUPPORTED_DTYPES)}. "
                "Import the model's unquantized (BF16/F16/F32) release"
            )
        if problem:
            raise CheckpointError(f"{path} is not a valid safetensors file: tensor {name!r} {problem}; "
                                  "re-download it")
        tensors[name] = info
        spans.append(tuple(info["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{path} is not a valid safetensors file: its tensors "
                                  f"{'overlap' if begin < end else 'leave a gap'} at byte {8 + length + begin}; "
                                  "re-download it")
        end = stop
    if end != data_len:
        raise CheckpointError(f"{path} is not a valid safetensors file: its tensors end at data byte {end}, the "
                              f"file has {data_len}; it is truncated or has extra bytes. Re-download it")
    return prefix + raw, tensors


def _tensor_problem(info: object, data_len: int) -> str | None:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return "lacks dtype, shape or data_offsets"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        return f"has dtype {dtype!r}"
    if dtype not in SUPPORTED_DTYPES:
        return "dtype"
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"has shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        return f"has data_offsets {offsets!r} outside the file's {data_len} data bytes"
    if offsets[1] - offsets[0] != math.prod(shape) * SUPPORTED_DTYPES[dtype]:
        return (f"has {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} "
                f"({math.prod(shape) * SUPPORTED_DTYPES[dtype]} expected)")
    return None


# ---------------------------------------------------------------- copying


class _Copier:
    """Read each source chunk once; hash it with every manifest digest and write it, each on its own thread.

    One single-thread executor per digest and one for the writes keep each stage in order; hashing and
    writing release the GIL, so the copy runs at the speed of the slowest stage (md5, about 0.7 GB/s a
    core, where the store reads faster than that).
    """

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress
        self.stages = {d: ThreadPoolExecutor(1, thread_name_prefix=f"import-{d}") for d in (*ALL_DIGESTS, "write")}
        self.free: deque[memoryview] = deque(memoryview(bytearray(CHUNK)) for _ in range(BUFFERS))
        self.inflight: deque[tuple[memoryview | None, list[Future]]] = deque()

    def close(self) -> None:
        for stage in self.stages.values():
            stage.shutdown(wait=True, cancel_futures=True)

    def _retire_oldest(self) -> None:
        buffer, futures = self.inflight.popleft()
        for future in futures:
            future.result()  # raises a hash or write error here
        if buffer is not None:
            self.free.append(buffer)

    def _drain(self) -> None:
        while self.inflight:
            self._retire_oldest()

    def _submit(self, fd: int, view: memoryview, offset: int, hashes: dict, buffer: memoryview | None) -> None:
        futures = [self.stages[d].submit(h.update, view) for d, h in hashes.items()]
        futures.append(self.stages["write"].submit(_write_all, fd, view, offset))
        self.inflight.append((buffer, futures))
        self.done += len(view)
        if self.progress:
            self.progress(self.done, self.total)

    def copy(self, src: Path, item: SourceFile, dst: Path) -> dict:
        """Copy one file; its manifest entry (size and every digest) from the bytes written."""
        hashes = {d: new_hash(d) for d in ALL_DIGESTS}
        target = dst / item.name
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise _write_error(target, e) from e
        try:
            if item.data is not None:
                view = memoryview(item.data)
                for offset in range(0, len(view), CHUNK):
                    if len(self.inflight) >= BUFFERS:
                        self._retire_oldest()
                    self._submit(fd, view[offset:offset + CHUNK], offset, hashes, None)
            else:
                self._stream(src / item.name, item, fd, hashes)
            self._drain()
            os.fsync(fd)
        except OSError as e:
            raise _write_error(target, e) from e
        finally:
            self._drain_quietly()
            os.close(fd)
        return {"size": item.size, **{d: h.hexdigest() for d, h in hashes.items()}}

    def _drain_quietly(self) -> None:
        """After an error: wait for the chunks in flight (their buffers and the fd are about to go)."""
        while self.inflight:
            try:
                self._retire_oldest()
            except Exception:  # the first error is the one being raised
                pass

    def _stream(self, path: Path, item: SourceFile, fd: int, hashes: dict) -> None:
        header = item.header or b""
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise CheckpointError(f"cannot read {path} ({e.strerror or e}); check its permissions") from e
        with f:
            offset = 0
            while offset < item.size:
                if not self.free:
                    self._retire_oldest()
                buffer = self.free.popleft()
                try:
                    n = f.readinto(buffer[:min(CHUNK, item.size - offset)])
                except OSError as e:
                    self.free.append(buffer)
                    raise CheckpointError(f"cannot read {path} at byte {offset} ({e.strerror or e}); "
                                          "check the file system and retry") from e
                if not n:
                    self.free.append(buffer)
                    raise CheckpointError(f"{path} ended at byte {offset} of {item.size} while being copied; it "
                                          "changed under us. Wait for whatever writes it and import again")
                if offset < len(header) and bytes(buffer[:min(n, len(header) - offset)]) != \
                        header[offset:offset + n]:
                    self.free.append(buffer)
                    raise CheckpointError(f"{path}'s header changed between the check and the copy; wait for "
                                          "whatever writes it and import again")
                self._submit(fd, buffer[:n], offset, hashes, buffer)
                offset += n
            if os.fstat(f.fileno()).st_size != item.size:
                raise CheckpointError(f"{path} changed size while being copied (was {item.size} bytes); wait for "
                                      "whatever writes it and import again")


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_error(path: Path, e: OSError) -> CheckpointError:
    fix = ("free space in the store (or its quota) or choose another --store"
           if e.errno in (errno.ENOSPC, errno.EDQUOT) else "check the store's file system and permissions")
    return CheckpointError(f"cannot write {path} ({e.strerror or e}); {fix}. Nothing was imported")


# ---------------------------------------------------------------- installing


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False  # the file system (NFS, some parallel file systems) cannot exchange
    raise OSError(code, os.strerror(code), str(b))


def _install(tmp: Path, dest: Path, replace: bool) -> Path | None:
    """Rename the finished copy ``tmp`` to ``dest``; the old copy's new path (for removal) when replacing."""
    if not replace:
        try:
            os.rename(tmp, dest)  # atomic; fails on a non-empty directory, so a racing import is not replaced
        except OSError as e:
            raise CheckpointError(f"{dest} appeared while importing ({e.strerror or e}); another import may "
                                  "have written it. Check it, then import again with --force to replace it") from e
        return None
    if _rename_exchange(tmp, dest):
        return tmp  # tmp now holds the old model
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, old)  # onto the empty directory mkdtemp made
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)  # put the old model back
        raise
    return old


def import_model(src: str | os.PathLike, store: str | os.PathLike, name: str, *, force: bool = False,
                 progress: Progress | None = None, note: Note | None = None) -> Path:
    """Copy the Hugging Face model directory ``src`` to ``<store>/<name>`` with its manifest; returns that path.

    ``force`` replaces an existing ``<store>/<name>`` atomically. ``progress(done, total)`` reports
    bytes copied; ``note(text)`` gets what was skipped (default: the log). Raises CheckpointError.
    """
    check_name(name)
    store = Path(store).expanduser()
    dest = store / name
    exists = os.path.lexists(dest)
    if exists and not force:
        raise CheckpointError(f"{dest} already exists; pass --force (force=True) to replace it (the new copy is "
                              "written beside it and renamed over it, so readers never see half of either), "
                              "or choose another name, e.g. NAME@v2 for a rollout version")
    if exists and (dest.is_symlink() or not dest.is_dir()):
        raise CheckpointError(f"{dest} exists and is not a directory; remove it or choose another name")
    plan = scan_source(src, note)
    try:
        store.mkdir(parents=True, exist_ok=True)
        stat = os.statvfs(store)
    except OSError as e:
        raise CheckpointError(f"cannot use the store {store} ({e.strerror or e}); create it or fix its "
                              "permissions, or choose another with --store") from e
    free = stat.f_bavail * stat.f_frsize
    if free < plan.total:
        raise CheckpointError(f"{store} has {free} bytes free, the model needs {plan.total}; free space or "
                              "choose another --store. Nothing was imported")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=store))  # 0700, as checkpoints are
    except OSError as e:
        raise _write_error(store, e) from e
    copier = _Copier(plan.total, progress)
    old = None
    try:
        files = {item.name: copier.copy(plan.src, item, tmp) for item in plan.files}
        manifest = (json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2, sort_keys=True) + "\n").encode()
        parse_manifest(tmp / MANIFEST_FILE, manifest)  # the format write_manifest writes and readers accept
        try:
            write_synced(tmp / MANIFEST_FILE, manifest)
            fsync_dir(tmp)
            old = _install(tmp, dest, exists)
            fsync_dir(store)
        except OSError as e:
            raise _write_error(dest, e) from e
    finally:
        copier.close()
        shutil.rmtree(old or tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # a no-op unless the fallback path left it
    return dest
