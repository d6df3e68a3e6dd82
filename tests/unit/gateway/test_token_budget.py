"""Quota groups' tokens_per_minute: a rolling 60 s window, refused with how long to wait."""

from __future__ import annotations

import pytest

from exaserve_hpc.gateway.admission import Admission, ApiError, TokenBudget


def test_budget_refuses_until_usage_ages_out():
    budget = TokenBudget({"bio": 1000})
    assert budget.wait("bio", 0.0) == 0.0
    budget.charge("bio", 600, 1.0)
    budget.charge("bio", 500, 10.0)
    assert budget.used("bio", 11.0) == 1100
    # Over the limit until the first 600 tokens age out at t = 61.
    assert budget.wait("bio", 11.0) == pytest.approx(50.0)
    assert budget.wait("bio", 61.5) == 0.0
    assert budget.used("bio", 61.5) == 500


def test_unlimited_groups_and_unknown_groups_never_wait():
    budget = TokenBudget({"bio": 10})
    budget.charge("climate", 10**9, 0.0)
    budget.charge(None, 10**9, 0.0)
    assert budget.wait("climate", 1.0) == 0.0 and budget.wait(None, 1.0) == 0.0


def test_admission_charges_on_release_and_answers_429_with_retry_after():
    now = [0.0]
    admission = Admission(10, {}, {"bio": 100}, clock=lambda: now[0])
    ticket = admission.admit("bio")
    now[0] = 5.0
    ticket.release(tokens=150)
    ticket.release(tokens=150)  # idempotent: charged once
    assert admission.budget.used("bio", 5.0) == 150
    with pytest.raises(ApiError) as info:
        admission.admit("bio")
    assert info.value.status == 429 and info.value.code == "quota_exceeded"
    assert "tokens_per_minute" in info.value.message and info.value.retry_after == pytest.approx(60.0)
    admission.admit("other")  # other groups are not affected
    now[0] = 65.1
    admission.admit("bio")
