"""Workload streams and the capacity answer for a request mix (pure functions)."""

from __future__ import annotations

import pytest

from exaserve_hpc.config.schema import load_site, resolve_site
from exaserve_hpc.controller.capacity import RequestMix, replicas_for_mix
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.sim.workload import DEFAULT_TRACE, arrivals, parse_workload, read_trace


def test_diurnal_swing_and_bursts():
    wl = parse_workload({"duration": "20m", "streams": [
        {"model": "m", "qps": 100, "diurnal": {"period": "20m", "trough": 0.2},
         "bursts": [{"at": "15m", "duration": "1m", "factor": 2}],
         "prefix_groups": {"count": 5, "system_tokens": 128}}]})
    per_minute = [0] * 20
    for r in arrivals(wl, wl.duration):
        per_minute[int(r.arrival // 60)] += 1
    assert per_minute[0] < 0.35 * per_minute[10]  # trough at the start, peak in the middle
    assert per_minute[15] > 1.5 * per_minute[16]  # the burst
    assert 0.8 * 100 * 60 < per_minute[10] < 1.2 * 100 * 60


def test_system_prompt_groups_share_leading_blocks():
    wl = parse_workload({"streams": [{"model": "m", "qps": 50, "prefix_groups": {"count": 3, "system_tokens": 256},
                                      "block_tokens": 64}]})
    firsts = {r.blocks[:4] for r in arrivals(wl, 60)}
    assert len(firsts) == 3  # three system prompts of four 64-token blocks


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the Mooncake trace is not on this machine")
def test_trace_rate_scaling_and_repeat():
    rows = read_trace(str(DEFAULT_TRACE))
    span = rows[-1][0]
    wl = parse_workload({"streams": [{"model": "m", "kind": "trace", "rate": 4}]})
    got = list(arrivals(wl, span / 2))  # at 4x, half the span holds the trace twice
    assert len(got) == pytest.approx(2 * len(rows), rel=0.01)
    assert got[0].blocks != got[len(rows) + 1].blocks  # the second pass has its own block ids


def test_capacity_for_a_mix_counts_gpu_sharing_and_headroom():
    site = load_site(resolve_site("small16-a100"))
    specs = catalogue_from_site(site)
    alone, = replicas_for_mix(specs, [RequestMix("llama-3.1-8b-instruct", 500, 400, 80)], {})
    shared, = replicas_for_mix(specs, [RequestMix("llama-3.1-8b-instruct", 500, 400, 80)],
                               {"llama-3.1-8b-instruct": 3})
    assert shared.requests_per_s_per_replica == pytest.approx(alone.requests_per_s_per_replica / 3)
    assert shared.replicas >= 500 * 1.3 / shared.requests_per_s_per_replica
    with pytest.raises(ValueError, match="does not serve"):
        replicas_for_mix(specs, [RequestMix("nope", 1, 1, 1)], {})


def test_peak_at_moves_the_swing_and_arrivals_follow_the_rate():
    """Two streams half a period apart; each second's arrivals thinned against that second's bound keep the
    Poisson rate (the count over the period is the rate's integral)."""
    wl = parse_workload({"streams": [
        {"model": "a", "qps": 50, "diurnal": {"period": "20m", "trough": 0.1, "peak_at": "5m"}},
        {"model": "b", "qps": 50, "diurnal": {"period": "20m", "trough": 0.1, "peak_at": "15m"}}]})
    per_minute = {"a": [0] * 20, "b": [0] * 20}
    for r in arrivals(wl, 1200):
        per_minute[r.model][int(r.arrival // 60)] += 1
    a, b = per_minute["a"], per_minute["b"]
    assert a.index(max(a)) in (3, 4, 5) and b.index(max(b)) in (13, 14, 15)
    assert a[15] < 0.3 * a[5] and b[5] < 0.3 * b[15]
    expected = sum(wl.streams[0].rate_at(t + 0.5) for t in range(1200))
    assert sum(a) == pytest.approx(expected, rel=0.03)
    s = wl.streams[0]
    assert all(s.bound(t / 10, t / 10 + 1) >= s.rate_at(t / 10 + k / 20) for t in range(0, 12000, 7) for k in range(20))
