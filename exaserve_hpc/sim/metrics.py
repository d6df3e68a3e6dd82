"""What a simulation measures: per-interval series and whole-run figures, kept small at any request rate.

Latencies of one interval are kept until it closes (its percentiles are exact); over the whole run they
go into log-spaced histograms (percentiles to within 2%), so a run of millions of requests keeps a few
thousand numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BUCKETS_PER_DECADE = 50
LOW = 1e-4  # seconds: the histograms' first bucket


class Histogram:
    def __init__(self):
        self.counts: dict[int, int] = {}
        self.n = 0
        self.total = 0.0

    def add(self, x: float) -> None:
        k = int(math.log10(max(x, LOW) / LOW) * BUCKETS_PER_DECADE)
        self.counts[k] = self.counts.get(k, 0) + 1
        self.n += 1
        self.total += x

    def quantile(self, q: float) -> float:
        if not self.n:
            return 0.0
        want, seen = q * self.n, 0
        for k in sorted(self.counts):
            seen += self.counts[k]
            if seen >= want:
                return LOW * 10 ** ((k + 1) / BUCKETS_PER_DECADE)
        return 0.0

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values.sort()
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Sample:
    t: float
    arrivals: int
    completed: int
    failed: int
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    gpu_util_allocated: float  # GPU work / (GPUs holding a replica x interval)
    gpu_util_all: float  # GPU work / (every GPU of the site x interval)
    gpus_allocated: int
    replicas: dict  # model -> serving replicas
    queue_depth: int  # requests waiting for a batch slot (replicas) or a replica (router)
    inflight: int
    prefix_hit_rate: float  # prompt tokens found in a prefix cache / prompt tokens, this interval
    nodes_live: int


@dataclass
class Recorder:
    interval: float
    samples: list[Sample] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    arrivals: int = 0
    completed: int = 0
    failed: int = 0
    ttft_all: Histogram = field(default_factory=Histogram)
    e2e_all: Histogram = field(default_factory=Histogram)
    events: list[tuple[float, str]] = field(default_factory=list)  # failures and recovery, in order
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by error code
    per_model: dict = field(default_factory=dict)  # model -> (TTFT histogram, end-to-end histogram)
    work_s: float = 0.0  # GPU-seconds of work up to the last sample
    gpu_seconds_allocated: float = 0.0
    hit: int = 0
    query: int = 0

    def first_token(self, latency: float, model: str = "") -> None:
        self.ttft.append(latency)
        self.ttft_all.add(latency)
        self._model(model)[0].add(latency)

    def done(self, latency: float, model: str = "") -> None:
        self.completed += 1
        self.e2e.append(latency)
        self.e2e_all.add(latency)
        self._model(model)[1].add(latency)

    def _model(self, model: str) -> tuple:
        hists = self.per_model.get(model)
        if hists is None:
            hists = self.per_model[model] = (Histogram(), Histogram())
        return hists

    def by_model(self) -> dict:
        """Per model: requests completed, TTFT and end-to-end p50 / p99 (one model can miss what the mix holds)."""
        return {m: {"completed": e.n, "ttft_p50_s": t.quantile(0.5), "ttft_p99_s": t.quantile(0.99),
                    "e2e_p50_s": e.quantile(0.5), "e2e_p99_s": e.quantile(0.99)}
                for m, (t, e) in sorted(self.per_model.items())}

    def error(self, code: str) -> None:
        self.failed += 1
        self.errors[code] = self.errors.get(code, 0) + 1

    def event(self, t: float, text: str) -> None:
        self.events.append((round(t, 3), text))

    def close(self, t: float, work_s: float, gpus_allocated: int, gpus_all: int, replicas: dict, queue: int,
              inflight: int, hit: int, query: int, nodes_live: int) -> Sample:
        """Close the interval ending at t."""
        work, self.work_s = work_s - self.work_s, work_s
        dh, dq = hit - self.hit, query - self.query
        self.hit, self.query = hit, query
        self.gpu_seconds_allocated += gpus_allocated * self.interval
        s = Sample(t, self.arrivals, self.completed, self.failed, quantile(self.ttft, 0.5), quantile(self.ttft, 0.99),
                   quantile(self.e2e, 0.5), quantile(self.e2e, 0.99),
                   min(1.0, work / max(1e-9, gpus_allocated * self.interval)),
                   min(1.0, work / max(1e-9, gpus_all * self.interval)), gpus_allocated, dict(replicas), queue,
                   inflight, dh / dq if dq else 0.0, nodes_live)
        self.samples.append(s)
        self.ttft, self.e2e = [], []
        return s
