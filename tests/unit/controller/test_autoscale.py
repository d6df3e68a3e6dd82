"""Autoscaler: thresholds, min replicas, cooldown between direction changes, reason labels."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exaserve_hpc.controller.autoscale import (AutoscalePolicy, Autoscaler, ModelLoad, ScalingHistory,
                                              autoscale, decide)

POLICY = AutoscalePolicy(scale_up_threshold=0.75, scale_down_threshold=0.25, cooldown_period=120.0,
                         default_min_replicas=4)


def load(replicas, queue, model="m", per_replica=10):
    return ModelLoad(model, replicas, queue, per_replica)


def test_load_is_queue_over_capacity():
    assert load(10, 50).load == 0.5
    assert load(0, 1).load == math.inf and load(0, 0).load == 0.0


def test_scale_up_above_threshold_to_the_middle_of_the_band():
    d = decide(load(10, 90), POLICY, ScalingHistory(), 0.0)  # load 0.9
    assert d.target == 18 and d.direction == 1  # 90 / (10 x 0.5)
    assert "load 0.90 > scale_up_threshold 0.75" in d.reason


def test_scale_down_below_threshold_never_below_min():
    d = decide(load(20, 10), POLICY, ScalingHistory(), 0.0)  # load 0.05
    assert d.target == 4 and "scale_down_threshold" in d.reason
    at_min = decide(load(4, 0), POLICY, ScalingHistory(), 0.0)
    assert at_min.target == 4 and "at min_replicas 4" in at_min.reason


def test_hold_inside_the_band():
    d = decide(load(10, 50), POLICY, ScalingHistory(), 0.0)
    assert d.delta == 0 and d.reason.startswith("hold: load 0.50 within")


def test_below_min_scales_up_at_once_even_in_cooldown():
    history = ScalingHistory({"m": {-1: 100.0}})
    d = decide(load(2, 0), POLICY, history, 101.0)
    assert d.target == 4 and "below min_replicas" in d.reason


def test_per_model_min_replicas():
    policy = AutoscalePolicy(min_replicas={"big": 1})
    assert decide(load(3, 0, "big"), policy, ScalingHistory(), 0.0).target == 1


def test_scale_down_waits_for_cooldown_after_a_scale_up():
    scaler = Autoscaler(POLICY)
    assert scaler.tick([load(10, 90)], now=0.0)[0].direction == 1
    assert scaler.tick([load(18, 150)], now=10.0)[0].direction == 1  # up again: allowed
    held = scaler.tick([load(28, 10)], now=60.0)[0]
    assert held.delta == 0 and "cooldown: scaled up 50s ago, scaling down waits 70s more" in held.reason
    # 120 s after the last up, the 30 replicas it asked for still count (the window includes its edge)
    assert scaler.tick([load(28, 10)], now=130.0)[0].delta == 0
    assert scaler.tick([load(28, 10)], now=131.0)[0].target == 4


def test_scale_up_never_waits_for_a_scale_down():
    """A scale-down that proved too deep is undone at once: the load above the threshold is queueing."""
    scaler = Autoscaler(POLICY)
    assert scaler.tick([load(20, 10)], now=0.0)[0].target == 4  # nothing asked for more lately: to the floor
    up = scaler.tick([load(4, 36)], now=5.0)[0]  # load 0.9, 5 s after the scale-down
    assert up.direction == 1 and up.target == 8


def test_scale_down_goes_no_lower_than_the_windows_peak():
    """A lull inside a busy cooldown_period does not cut the fleet the load needed a moment ago."""
    scaler = Autoscaler(POLICY)
    steady = [scaler.tick([load(40, 200)], now=float(t))[0] for t in range(0, 200, 10)]  # 40 wanted: hold
    assert all(d.delta == 0 for d in steady)
    lull = scaler.tick([load(40, 20)], now=200.0)[0]  # load 0.05 would want 4
    assert lull.delta == 0 and "peaked at 40" in lull.reason
    scaler.tick([load(40, 100)], now=250.0)  # 20 wanted
    d = scaler.tick([load(40, 20)], now=320.0)[0]  # the 40s are 120 s old; 20 (at 250 s) is the window's peak
    assert d.target == 20 and "peak" in d.reason
    d = scaler.tick([load(20, 10)], now=380.0)[0]  # 250 s is past the window: down to what is asked now
    assert d.target == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40)), min_size=2, max_size=40))
def test_scale_downs_respect_the_cooldown_and_the_window(steps):
    """Every scale-down comes a cooldown_period after the last scale-up and keeps at least the most
    replicas any tick of the last cooldown_period asked for; scale-ups are never held back."""
    scaler = Autoscaler(POLICY)
    replicas, now, asked, last_up = 5, 0.0, [], -math.inf
    for dt, queue_per in steps:
        now += dt * 20
        current = load(replicas, queue_per * replicas / 4)
        d = scaler.tick([current], now)[0]
        wanted = math.ceil(current.queue_depth / (10 * POLICY.target_load) - 1e-9)
        assert d.target >= 4 or d.target >= d.current
        if current.load > POLICY.scale_up_threshold:
            assert d.direction == 1
        if d.direction == -1:
            assert now - last_up >= POLICY.cooldown_period
            window = [w for t, w in asked if t >= now - POLICY.cooldown_period]
            assert d.target >= max(window + [wanted, 4])
        if d.direction == 1:
            last_up = now
        asked.append((now, wanted))
        replicas = d.target


def test_tick_over_fifty_models_labels_every_decision():
    loads = [load(10, q, f"model{q}") for q in range(0, 100, 2)]
    decisions, history = autoscale(loads, POLICY, ScalingHistory(), 5.0)
    assert len(decisions) == 50 and all(d.reason for d in decisions)
    assert {d.direction for d in decisions} == {-1, 0, 1}
    assert all(history.last_at(d.model, d.direction) == 5.0 for d in decisions if d.direction)


def test_policy_rejects_inverted_thresholds():
    with pytest.raises(ValueError, match="below scale_up_threshold"):
        AutoscalePolicy(scale_up_threshold=0.3, scale_down_threshold=0.5)
