"""Simulator workloads: a YAML file of request streams, fault injections and the latency SLO.

The format (docs/simulator.md):

    name: diurnal-mix
    duration: 1h                   # simulated time (``exaserve simulate --duration`` overrides)
    slo: {ttft_p99: 2s, e2e_p99: 60s}
    streams:                       # one per model (or several for one model)
      - model: llama-3.1-8b-instruct
        kind: synthetic            # Poisson arrivals
        qps: 400                   # peak requests/s
        diurnal: {period: 1h, trough: 0.3}   # rate = qps x (trough .. 1 .. trough) over a period
                                   # peak_at: 15m moves the peak (default: half a period)
        bursts: [{at: 20m, duration: 2m, factor: 2}]
        input_tokens: {mean: 600, sigma: 0.6, max: 8000}    # lognormal
        output_tokens: {mean: 150, sigma: 0.5, max: 1024}
        prefix_groups: {count: 200, system_tokens: 1024, zipf: 1.1}  # shared system prompts
        block_tokens: 64           # granularity of prefix identity (a multiple of router.block_size)
      - model: mistral-7b-instruct
        kind: trace                # Mooncake format: timestamp (ms), input_length, output_length, hash_ids
        path: ../shared/traces/mooncake_conversation_trace.jsonl  # default: $EXASERVE_TRACE, else shared/ beside the checkout
        rate: 10                   # arrival rate x10 (timestamps / 10); the trace repeats to fill duration
        block_tokens: 512          # the trace's hash_ids are 512-token blocks
    faults:
      - {at: 10m, kind: node_loss, node: gpu05}
      - {at: 20m, kind: fault_group_loss, group: rack02}
      - {at: 30m, kind: slow_node, node: gpu07, factor: 3}
      - {at: 40m, kind: controller_node_loss}

Every request is a `Request` (arrival, model, prompt tokens, max tokens, prefix block ids). Block ids are
chained (two prompts share block k only if they share blocks 0..k), as the trace's hash ids are.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import yaml

from exaserve_hpc.units import parse_duration

FAULT_KINDS = ("node_loss", "fault_group_loss", "slow_node", "controller_node_loss")
STREAM_KINDS = ("synthetic", "trace")
def _default_trace() -> Path:
    """The Mooncake conversation trace: $EXASERVE_TRACE, else the shared/ directory beside this checkout,
    else the development machines' /work/shared."""
    name = "traces/mooncake_conversation_trace.jsonl"
    if os.environ.get("EXASERVE_TRACE"):
        return Path(os.environ["EXASERVE_TRACE"])
    beside = Path(__file__).resolve().parents[3] / "shared" / name
    return beside if beside.is_file() else Path("/work/shared") / name


DEFAULT_TRACE = _default_trace()


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the key."""


class Request(NamedTuple):  # a tuple: made once per request, and merged by arrival (its first field)
    arrival: float
    model: str
    prompt: int
    max_tokens: int
    blocks: tuple
    block_tokens: int


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    node: str = ""
    group: str = ""
    factor: float = 3.0


@dataclass
class Stream:
    model: str
    kind: str
    qps: float = 0.0
    trough: float = 1.0
    period: float = 3600.0
    peak_at: Optional[float] = None  # when the swing peaks (again every period); None: half a period
    bursts: list = field(default_factory=list)  # (at, duration, factor)
    input_tokens: dict = field(default_factory=lambda: {"mean": 600, "sigma": 0.6, "max": 8000})
    output_tokens: dict = field(default_factory=lambda: {"mean": 150, "sigma": 0.5, "max": 1024})
    groups: int = 0
    system_tokens: int = 0
    zipf: float = 1.1
    block_tokens: int = 64
    path: str = ""
    rate: float = 1.0

    def rate_at(self, t: float) -> float:
        """Requests/s at time t (synthetic streams)."""
        swing = self._swing(t) if self.trough < 1 else 1.0
        r = self.qps * (self.trough + (1 - self.trough) * swing)
        for at, duration, factor in self.bursts:
            if at <= t < at + duration:
                r *= factor
        return r

    @property
    def peak(self) -> float:
        return self.period / 2 if self.peak_at is None else self.peak_at

    def _swing(self, t: float) -> float:
        """0 in the trough .. 1 at the peak, a cosine over the period."""
        return 0.5 * (1 + math.cos(2 * math.pi * (t - self.peak) / self.period))

    def bound(self, start: float, end: float) -> float:
        """An upper bound of rate_at over [start, end): the swing is a cosine, so its value at the larger end,
        or 1 where a peak (peak_at + k periods) lies inside; overlapping bursts count at their factor."""
        swing = 1.0
        if self.trough < 1:
            k = math.floor((start - self.peak) / self.period)
            if not any(start <= self.peak + (k + j) * self.period < end for j in (0, 1)):
                swing = max(self._swing(start), self._swing(end))
        factor = max([1.0] + [f for at, d, f in self.bursts if at < end and start < at + d])
        return self.qps * (self.trough + (1 - self.trough) * swing) * factor * (1 + 1e-9)


@dataclass
class Workload:
    name: str
    duration: float
    streams: list[Stream]
    faults: list[Fault] = field(default_factory=list)
    slo_ttft_p99: float = 2.0
    slo_e2e_p99: float = 60.0

    def models(self) -> list[str]:
        return sorted({s.model for s in self.streams})

    def scaled(self, factor: float) -> "Workload":
        """The same workload at `factor` times the rate."""
        streams = [Stream(**{**vars(s), "qps": s.qps * factor, "rate": s.rate * factor}) for s in self.streams]
        return Workload(self.name, self.duration, streams, list(self.faults), self.slo_ttft_p99, self.slo_e2e_p99)


def _duration(value, key: str) -> float:
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise WorkloadError(f"{key}: {exc}") from None


def parse_workload(data: dict, name: str = "workload") -> Workload:
    if not isinstance(data, dict) or not isinstance(data.get("streams"), list) or not data["streams"]:
        raise WorkloadError(f"{name}: needs a non-empty 'streams' list")
    streams = []
    for k, s in enumerate(data["streams"]):
        where = f"streams[{k}]"
        kind = s.get("kind", "synthetic")
        if kind not in STREAM_KINDS:
            raise WorkloadError(f"{where}.kind is {kind!r}; choose one of {', '.join(STREAM_KINDS)}")
        if "model" not in s:
            raise WorkloadError(f"{where}: needs 'model' (a model_name of the site)")
        diurnal = s.get("diurnal") or {}
        groups = s.get("prefix_groups") or {}
        stream = Stream(
            model=s["model"], kind=kind, qps=float(s.get("qps", 0.0)), trough=float(diurnal.get("trough", 1.0)),
            period=_duration(diurnal.get("period", "1h"), f"{where}.diurnal.period"),
            peak_at=_duration(diurnal["peak_at"], f"{where}.diurnal.peak_at") if "peak_at" in diurnal else None,
            bursts=[(_duration(b["at"], f"{where}.bursts.at"), _duration(b["duration"], f"{where}.bursts.duration"),
                     float(b.get("factor", 2.0))) for b in s.get("bursts", [])],
            input_tokens={"mean": 600, "sigma": 0.6, "max": 8000, **(s.get("input_tokens") or {})},
            output_tokens={"mean": 150, "sigma": 0.5, "max": 1024, **(s.get("output_tokens") or {})},
            groups=int(groups.get("count", 0)), system_tokens=int(groups.get("system_tokens", 0)),
            zipf=float(groups.get("zipf", 1.1)),
            block_tokens=int(s.get("block_tokens", 512 if kind == "trace" else 64)),
            path=str(s.get("path", DEFAULT_TRACE)), rate=float(s.get("rate", 1.0)))
        if kind == "synthetic" and stream.qps <= 0:
            raise WorkloadError(f"{where}.qps must be > 0 for a synthetic stream")
        if not 0 <= stream.trough <= 1:
            raise WorkloadError(f"{where}.diurnal.trough must be within 0..1, got {stream.trough}")
        if kind == "trace" and not Path(stream.path).is_file():
            raise WorkloadError(f"{where}.path: no trace file at {stream.path}")
        streams.append(stream)
    faults = []
    for k, f in enumerate(data.get("faults") or []):
        if f.get("kind") not in FAULT_KINDS:
            raise WorkloadError(f"faults[{k}].kind is {f.get('kind')!r}; choose one of {', '.join(FAULT_KINDS)}")
        faults.append(Fault(_duration(f["at"], f"faults[{k}].at"), f["kind"], str(f.get("node", "")),
                            str(f.get("group", "")), float(f.get("factor", 3.0))))
    slo = data.get("slo") or {}
    return Workload(str(data.get("name", name)), _duration(data.get("duration", "10m"), "duration"), streams,
                    sorted(faults, key=lambda f: f.at), _duration(slo.get("ttft_p99", "2s"), "slo.ttft_p99"),
                    _duration(slo.get("e2e_p99", "60s"), "slo.e2e_p99"))


def builtin_dir() -> Path:
    return Path(__file__).resolve().parent / "workloads"


def resolve_workload(arg: str) -> Path:
    """A workload by file path, or by name among the ones shipped (exaserve_hpc/sim/workloads/NAME.yaml)."""
    path = Path(arg)
    if path.is_file():
        return path
    shipped = builtin_dir() / f"{arg}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in builtin_dir().glob("*.yaml")))
    raise WorkloadError(f"no workload file {arg!r}; give a YAML path or one of: {names}")


def load_workload(arg: str) -> Workload:
    path = resolve_workload(arg)
    return parse_workload(yaml.safe_load(path.read_text()), path.stem)


# ---------------------------------------------------------------- request streams


def _lognormal(rng: random.Random, spec: dict) -> int:
    sigma = float(spec.get("sigma", 0.5))
    mu = math.log(max(1.0, float(spec["mean"]))) - sigma * sigma / 2
    return max(1, min(int(spec.get("max", 1 << 20)), int(rng.lognormvariate(mu, sigma))))


def synthetic(stream: Stream, index: int, duration: float, seed: int) -> Iterator[Request]:
    """Poisson arrivals at stream.rate_at(t), by thinning against the rate's bound over each second (not the
    peak over the whole run: in a diurnal trough that rejected most candidates, a rate_at call each)."""
    rng = random.Random(seed * 1000 + index)
    b = stream.block_tokens
    sys_blocks = stream.system_tokens // b
    cum = list(itertools.accumulate(1 / (g + 1) ** stream.zipf for g in range(stream.groups)))
    acc = cum[-1] if cum else 0.0
    base = (index + 1) << 40  # block ids unique to this stream
    unique = base + (1 << 36)
    rate_at, expo, uniform, lognormal = stream.rate_at, rng.expovariate, rng.random, _lognormal
    window, t = 0.0, 0.0
    while window < duration:
        end = min(window + 1.0, duration)
        bound = stream.bound(window, end)
        while bound > 0:
            t += expo(bound)
            if t >= end:
                break
            if uniform() * bound > rate_at(t):
                continue
            prompt, out = lognormal(rng, stream.input_tokens), lognormal(rng, stream.output_tokens)
            if stream.groups:
                g = min(stream.groups - 1, bisect.bisect_left(cum, uniform() * acc))
                prompt = max(prompt, stream.system_tokens + 1)  # the system prompt, then the user's part
                first = base + (g << 20)
                blocks = [*range(first, first + sys_blocks)]
            else:
                blocks = []
            n = prompt // b - len(blocks)
            if n > 0:
                blocks += range(unique + 1, unique + n + 1)
                unique += n
            yield Request(t, stream.model, prompt, out, tuple(blocks), b)
        window = t = end  # memoryless: the next window's arrivals start afresh at its start


def read_trace(path: str) -> list[tuple[float, int, int, tuple]]:
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.append((r["timestamp"] / 1000.0, int(r["input_length"]), max(1, int(r["output_length"])),
                         tuple(r["hash_ids"])))
    return rows


def trace(stream: Stream, index: int, duration: float, rows: Optional[list] = None) -> Iterator[Request]:
    """The trace's arrivals divided by `rate`, repeated (with fresh block ids each pass) to fill duration."""
    rows = rows if rows is not None else read_trace(stream.path)
    if not rows:
        return
    span = rows[-1][0] + 1e-3
    base = (index + 1) << 40
    lap = 0
    while True:
        offset = lap * span
        for ts, n, out, hashes in rows:
            t = (offset + ts) / stream.rate
            if t >= duration:
                return
            yield Request(t, stream.model, n, out, tuple(base + (lap << 32) + h for h in hashes),
                          stream.block_tokens)
        lap += 1


def arrivals(workload: Workload, duration: float, seed: int = 0) -> Iterator[Request]:
    """Every stream's requests merged in arrival order."""
    its = [synthetic(s, k, duration, seed) if s.kind == "synthetic" else trace(s, k, duration)
           for k, s in enumerate(workload.streams)]
    return heapq.merge(*its)  # tuples: by arrival, then the other fields (a tie is rare)


def workload_from_args(args, console) -> Optional[Workload]:
    """The workload `--workload` names, scaled by `--rate` (simulate and capacity); None after printing why not."""
    try:
        workload = load_workload(args.workload)
    except WorkloadError as exc:
        console.print(f"[red]error[/]: {exc}", highlight=False)
        return None
    return workload.scaled(args.rate) if args.rate else workload
