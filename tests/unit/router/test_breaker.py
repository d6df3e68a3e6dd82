"""Circuit breaker: opens after consecutive failures, one half-open probe, doubling cool-off."""

from __future__ import annotations

from exaserve_hpc.router.breaker import BreakerSettings, BreakerState, CircuitBreaker


def test_opens_after_consecutive_failures_only():
    b = CircuitBreaker(BreakerSettings(failures=3, cooloff=10))
    assert not b.on_failure(0) and not b.on_failure(1)
    b.on_success()  # a success in between resets the count
    assert not b.on_failure(2) and not b.on_failure(3)
    assert b.on_failure(4)
    assert b.state is BreakerState.OPEN and not b.available(5)


def test_half_open_lets_exactly_one_probe_through_then_closes_on_success():
    b = CircuitBreaker(BreakerSettings(failures=1, cooloff=10))
    b.on_failure(0)
    assert not b.available(9.9)
    assert b.available(10.0) and b.state is BreakerState.HALF_OPEN
    b.on_dispatch()
    assert not b.available(10.1)  # the probe is out: nobody else
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.available(10.2)


def test_failed_probe_reopens_with_doubled_cooloff_capped():
    b = CircuitBreaker(BreakerSettings(failures=1, cooloff=10, max_cooloff=25))
    b.on_failure(0)
    assert b.available(10)
    b.on_dispatch()
    assert b.on_failure(11)
    assert b.state is BreakerState.OPEN and b.cooloff == 20
    assert not b.available(30) and b.available(31)
    b.on_dispatch()
    b.on_failure(32)
    assert b.cooloff == 25  # capped
    b.available(57)
    b.on_success()
    assert b.cooloff == 10


def test_late_failures_while_open_do_not_extend_it():
    b = CircuitBreaker(BreakerSettings(failures=1, cooloff=10))
    b.on_failure(0)
    assert not b.on_failure(5)
    assert b.available(10)
