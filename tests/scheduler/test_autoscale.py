"""Autoscaler: thresholds, min replicas, cooldown between direction changes, reason labels."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exaserve_hpc.scheduler.autoscale import (AutoscalePolicy, Autoscaler, ModelLoad, ScalingHistory,
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


def test_reversal_waits_for_cooldown_but_same_direction_does_not():
    scaler = Autoscaler(POLICY)
    assert scaler.tick([load(10, 90)], now=0.0)[0].direction == 1
    assert scaler.tick([load(18, 150)], now=10.0)[0].direction == 1  # up again: allowed
    held = scaler.tick([load(28, 10)], now=60.0)[0]
    assert held.delta == 0 and "cooldown: scaled up 50s ago, reversing waits 70s more" in held.reason
    assert scaler.tick([load(28, 10)], now=130.0)[0].direction == -1  # 120 s after the last up


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40)), min_size=2, max_size=40))
def test_at_most_one_direction_change_per_cooldown(steps):
    scaler = Autoscaler(POLICY)
    replicas, now, changes = 5, 0.0, []
    last_direction = 0
    for dt, queue_per in steps:
        now += dt * 20
        d = scaler.tick([load(replicas, queue_per * replicas / 4)], now)[0]
        assert d.target >= 4 or d.target >= d.current
        if d.direction and d.direction != last_direction and last_direction:
            changes.append(now)
        if d.direction:
            last_direction = d.direction
        replicas = d.target
    assert all(b - a >= POLICY.cooldown_period for a, b in zip(changes, changes[1:]))


def test_tick_over_fifty_models_labels_every_decision():
    loads = [load(10, q, f"model{q}") for q in range(0, 100, 2)]
    decisions, history = autoscale(loads, POLICY, ScalingHistory(), 5.0)
    assert len(decisions) == 50 and all(d.reason for d in decisions)
    assert {d.direction for d in decisions} == {-1, 0, 1}
    assert all(history.last_at(d.model, d.direction) == 5.0 for d in decisions if d.direction)


def test_policy_rejects_inverted_thresholds():
    with pytest.raises(ValueError, match="below scale_up_threshold"):
        AutoscalePolicy(scale_up_threshold=0.3, scale_down_threshold=0.5)
