"""Weight tier benchmark: L3 -> L2 and L2 -> L1 against raw baselines, and replica cold start hit vs miss.

Run: .venv/bin/python benchmarks/bench_weights.py [--size-gb 2] [--rounds 3] [--dir /tmp/...]
                                                    [--shm /dev/shm] [--huge-tmpfs auto|no|PATH]

Side by side in one run on a checkpoint of --size-gb (float32 Llama-style,
written with the tiny-checkpoint creator and a real manifest):
- L3 -> L2: copy_verified (BLAKE3 checked: the manifest's read digest) into
  --shm (a tmpfs with 4 KiB pages, as /dev/shm usually is) and into a tmpfs
  with huge pages (``huge=within_size``: ``auto`` mounts one in a temp dir
  when run as root; or give the path of one; weight_cache.l2_path is where a
  site puts L2), against a raw sequential read of the same files (readinto a
  reused buffer, like dd to /dev/null; and numpy.fromfile into fresh
  memory), page cache dropped before every measurement when
  /proc/sys/vm/drop_caches is writable. The variants run interleaved, one
  of each per round, so a slow spell of a shared disk hits all of them; the
  ratio is also given per round (copy / raw read of the same round).
- L2 -> L1: load_from_l2 (shared memory -> private numpy arrays), against a
  raw memcpy of the same bytes from the same mappings into fresh arrays, on
  each L2 kind, rounds interleaved.
- Replica cold start through a real node agent: L3 miss (cold page cache)
  vs L2 hit, time from StartReplica to "serving".
Medians over --rounds, min and max alongside. Files are removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exaserve_hpc.agent.node_agent import NodeAgent  # noqa: E402
from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint  # noqa: E402
from exaserve_hpc.cache.l3_store import copy_verified, read_manifest  # noqa: E402
from exaserve_hpc.cache.tiers import load_from_l2, shard_names  # noqa: E402
from exaserve_hpc.protocol import (  # noqa: E402
    EngineSettings, ReplicaEvent, Shutdown, StartReplica, StopReplica, decode, encode,
)

CHUNK = 16 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def pretouch(nbytes: int) -> None:
    """Touch memory once: on VMs the first touch of a guest page is slow and would skew whichever runs first."""
    for _ in range(max(1, nbytes // (1 << 30))):
        a = np.ones(1 << 30, np.uint8)
        del a


def huge_tmpfs(how: str) -> tuple[Path | None, str]:
    """(a tmpfs directory with huge pages, "mounted" | "given") or (None, why not)."""
    if how == "no":
        return None, "--huge-tmpfs no"
    if how != "auto":
        return Path(tempfile.mkdtemp(prefix="exaserve-bench-l2h-", dir=how)), "given"
    point = Path(tempfile.mkdtemp(prefix="exaserve-bench-l2h-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=50%", "tmpfs", str(point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        point.rmdir()
        return None, f"mount failed ({done.stderr.strip() or done.returncode}); run as root or give --huge-tmpfs PATH"
    return point, "mounted"


def spec_for(size_gb: float) -> TinyModelSpec:
    hidden, inter = 2048, 5504
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 4
    layers = max(1, round(size_gb * 1e9 / per_layer))
    return TinyModelSpec(layers=layers, hidden=hidden, heads=16, kv_heads=16, intermediate=inter,
                         max_position=256, shards=8, dtype="float32")


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ---------------------------------------------------------------- L3 -> L2

def raw_read(ckpt: Path, names: list[str]) -> None:
    buf = bytearray(CHUNK)
    for name in names:
        with open(ckpt / name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def raw_fromfile(ckpt: Path, names: list[str]) -> None:
    for name in names:
        a = np.fromfile(ckpt / name, np.uint8)
        del a


def l3_to_l2(ckpt: Path, shm: Path, digests: tuple[str, ...] | None = None) -> None:
    target = shm / "entry"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    copy_verified(ckpt, target, digests=digests)


# ---------------------------------------------------------------- L2 -> L1

def raw_memcpy(entry: Path) -> None:
    for name in shard_names(entry):
        with open(entry / name, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        src = np.frombuffer(mm, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        del src, dst
        mm.close()


def l2_to_l1(entry: Path) -> None:
    config, weights = load_from_l2(entry)
    del weights


# ---------------------------------------------------------------- cold start

class Controller:
    """A fake controller socket and a real agent in a thread."""

    def __init__(self, l2_root: Path, l2_capacity: int):
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.backend = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.agent = NodeAgent(f"tcp://127.0.0.1:{port}", "bench", 1.0, l2_root=str(l2_root),
                               l2_capacity=l2_capacity, pool_bytes=64 << 30)
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        self.peer = self._wait(lambda m: True).agent_id.encode()

    def _wait(self, predicate, timeout: float = 600.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                _, frame = self.socket.recv_multipart()
                message = decode(frame)
                if predicate(message):
                    return message
        raise TimeoutError("no answer from the agent")

    def start_until_serving(self, replica_id: str, ckpt: Path) -> tuple[float, dict[str, float]]:
        started = time.perf_counter()
        self.socket.send_multipart([self.peer, encode(StartReplica(
            replica_id=replica_id, model="bench", model_dir=str(ckpt), router_backend=self.backend,
            settings=EngineSettings(engine="reference", max_batch_size=1, max_seq_len=64)))])
        steps, previous = {}, ""
        while True:
            event = self._wait(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == replica_id)
            if steps or event.state != "reserving":
                steps[previous] = event.seconds_in_previous_state
            previous = event.state
            if event.state == "failed":
                raise RuntimeError(event.detail)
            if event.state == "serving":
                return time.perf_counter() - started, steps

    def stop(self, replica_id: str) -> None:
        self.socket.send_multipart([self.peer, encode(StopReplica(replica_id=replica_id, drain_timeout=1.0))])
        self._wait(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == replica_id
                   and m.state in ("stopped", "failed"))

    def close(self) -> None:
        self.socket.send_multipart([self.peer, encode(Shutdown(drain_timeout=1.0))])
        self.thread.join(30)
        self.socket.close()


def interleaved(fns: dict, rounds: int, before=None) -> dict[str, list[float]]:
    """Seconds per round for each of ``fns``, one of each per round."""
    out = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            if before:
                before()
            t = time.perf_counter()
            fn()
            out[label].append(time.perf_counter() - t)
    return out


def measure(fn, rounds: int, before=None) -> list[float]:
    out = []
    for _ in range(rounds):
        if before:
            before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def line(label: str, nbytes: int, times: list[float]) -> float:
    med = rate(nbytes, statistics.median(times))
    print(f"  {label:<44} {med:6.2f} GB/s   (min {rate(nbytes, max(times)):.2f}, max {rate(nbytes, min(times)):.2f})")
    return med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the L3 checkpoint (default: a temp dir in /tmp)")
    parser.add_argument("--shm", default="/dev/shm", help="the usual L2 tmpfs (4 KiB pages)")
    parser.add_argument("--huge-tmpfs", default="auto",
                        help="a tmpfs with huge pages: auto (mount one if root), no, or its path")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exaserve-bench-weights-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="exaserve-bench-l2-", dir=args.shm))
    huge, mounted = huge_tmpfs(args.huge_tmpfs)
    try:
        spec = spec_for(args.size_gb)
        t = time.perf_counter()
        ckpt = create_tiny_checkpoint(work / "model", spec)
        entries, _ = read_manifest(ckpt)
        names = [e.name for e in entries]
        total = sum(e.size for e in entries)
        dropped = drop_caches()
        print(f"checkpoint: {total / 1e9:.2f} GB in {len(entries)} files ({spec.layers} layers, hidden "
              f"{spec.hidden}, float32), written in {time.perf_counter() - t:.0f}s; cpus: {os.cpu_count()}; "
              f"page cache dropped before each cold read: {'yes' if dropped else 'NO (not permitted)'}")
        pretouch(3 * total)
        cold = drop_caches if dropped else None

        print(f"L3 -> L2 (cold page cache), median of {args.rounds}, interleaved:")
        kinds = {"4k": (shm, "4 KiB pages")}
        if huge is not None:
            kinds["huge"] = (huge, "huge pages")
        else:
            print(f"  (no huge-page tmpfs: {mounted})")
        variants = {"raw": lambda: raw_read(ckpt, names), "fromfile": lambda: raw_fromfile(ckpt, names)}
        for kind, (where, _) in kinds.items():
            variants[f"blake3 {kind}"] = lambda where=where: l3_to_l2(ckpt, where)
            variants[f"none {kind}"] = lambda where=where: l3_to_l2(ckpt, where, ())
        times = interleaved(variants, args.rounds, cold)
        times["sha256"] = measure(lambda: l3_to_l2(ckpt, shm, ("sha256",)), 1, cold)
        raw = line("raw sequential read (readinto, like dd)", total, times["raw"])
        fromfile = line("raw numpy.fromfile (fresh memory)", total, times["fromfile"])
        results = {}
        for kind, (where, pages) in kinds.items():
            results[kind] = line(f"copy_verified, blake3, {pages}", total, times[f"blake3 {kind}"])
            line(f"copy_verified, no checksum, {pages}", total, times[f"none {kind}"])
        legacy = line("copy_verified, sha256 (old), 4 KiB pages", total, times["sha256"])
        for kind, (where, pages) in kinds.items():
            paired = sorted(r / b for r, b in zip(times["raw"], times[f"blake3 {kind}"]))
            print(f"  => L3->L2 (blake3, {pages}) = {results[kind] / raw:.0%} of raw read, "
                  f"{results[kind] / fromfile:.0%} of numpy.fromfile (target >= 80%); "
                  f"per round {', '.join(f'{p:.0%}' for p in paired)}")
        print(f"  => sha256 fallback: {legacy / raw:.0%} of raw read")

        print(f"L2 -> L1, median of {args.rounds}:")
        for kind, (where, pages) in kinds.items():
            l3_to_l2(ckpt, where)
            entry = where / "entry"
            copies = interleaved({"memcpy": lambda: raw_memcpy(entry), "load": lambda: l2_to_l1(entry)},
                                 args.rounds)
            memcpy = line(f"raw memcpy of the same bytes, {pages}", total, copies["memcpy"])
            l1 = line(f"load_from_l2 (tensors -> private arrays), {pages}", total, copies["load"])
            paired = sorted(m / l for m, l in zip(copies["memcpy"], copies["load"]))
            print(f"  => L2->L1 ({pages}) = {l1 / memcpy:.0%} of raw memcpy (target >= 80%); "
                  f"per round {', '.join(f'{p:.0%}' for p in paired)}")
            shutil.rmtree(entry)

        l2_dir, pages = kinds["huge" if "huge" in kinds else "4k"]
        print(f"replica cold start (StartReplica -> serving, real agent and replica process; L2 with {pages}):")
        controller = Controller(l2_dir / "agent-l2", l2_capacity=total * 2)
        try:
            if dropped:
                drop_caches()
            miss, miss_steps = controller.start_until_serving("miss", ckpt)
            controller.stop("miss")
            hit, hit_steps = controller.start_until_serving("hit", ckpt)
            controller.stop("hit")
        finally:
            controller.close()
        fmt = lambda steps: ", ".join(f"{k} {v:.2f}s" for k, v in steps.items())  # noqa: E731
        print(f"  L3 miss: {miss:6.2f}s  ({fmt(miss_steps)})")
        print(f"  L2 hit:  {hit:6.2f}s  ({fmt(hit_steps)})")
        print(f"  => hit / miss = {hit / miss:.2f} (miss is {miss / hit:.1f}x slower)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if huge is not None:
            shutil.rmtree(huge / "entry", ignore_errors=True)
            shutil.rmtree(huge / "agent-l2", ignore_errors=True)
            if mounted == "mounted":
                subprocess.run(["umount", str(huge)], check=False)
                huge.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
