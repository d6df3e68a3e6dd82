"""The pure lease policy: when a leader acts, renews, steps down; the settings' bounds."""

import pytest

from exaserve_hpc.config.schema import HaConfig
from exaserve_hpc.config.lease_bounds import default_renew_interval, lease_problems, margin_for
from exaserve_hpc.ha.lease_policy import LeaderAction, LeaseTiming, act_deadline, leader_decision, seconds_left

T = LeaseTiming.from_settings(10.0)  # renew every 2 s, margin 2.5 s


def test_defaults():
    assert (T.ttl, T.renew_interval, T.margin) == (10.0, 2.0, 2.5)
    assert default_renew_interval(5.0) == 1.0 and margin_for(2.0) == 0.5


def test_act_then_renew_then_step_down_before_expiry():
    assert leader_decision(100.0, 100.0, 10, T) is LeaderAction.ACT
    assert leader_decision(101.9, 100.0, 10, T) is LeaderAction.ACT
    assert leader_decision(102.0, 100.0, 10, T) is LeaderAction.RENEW
    assert leader_decision(107.4, 100.0, 10, T) is LeaderAction.RENEW
    # stops acting margin seconds before the earliest moment etcd could expire the lease (sent_at + TTL)
    assert act_deadline(100.0, 10, T) == 107.5
    assert leader_decision(107.5, 100.0, 10, T) is LeaderAction.STEP_DOWN
    assert leader_decision(500.0, 100.0, 10, T) is LeaderAction.STEP_DOWN


def test_seconds_left_counts_down_to_the_step_down_and_never_below_zero():
    assert seconds_left(100.0, True, 100.0, 10, T) == 7.5
    assert seconds_left(105.0, True, 100.0, 10, T) == 2.5
    assert seconds_left(107.5, True, 100.0, 10, T) == 0.0  # the moment leader_decision says STEP_DOWN
    assert seconds_left(500.0, True, 100.0, 10, T) == 0.0
    assert seconds_left(100.0, True, 100.0, 4, T) == 1.5   # a shorter grant counts from its own TTL
    assert seconds_left(100.0, True, 100.0, 0, T) == 0.0   # an expired lease
    assert seconds_left(100.0, False, 100.0, 10, T) == 0.0  # a standby


def test_expired_or_shorter_grant():
    assert leader_decision(100.0, 100.0, 0, T) is LeaderAction.STEP_DOWN
    assert leader_decision(100.0, 100.0, -1, T) is LeaderAction.STEP_DOWN
    # etcd granted less than asked (a lease renewed late): the deadline follows the grant
    assert act_deadline(100.0, 4, T) == 101.5
    assert leader_decision(101.5, 100.0, 4, T) is LeaderAction.STEP_DOWN


@pytest.mark.parametrize("ttl,renew,fragment", [
    (1.0, None, "ha.lease_ttl is 1s; allowed: 2s to 300s"),
    (301.0, None, "ha.lease_ttl is 301s"),
    (10.0, 4.0, "ha.renew_interval is 4s; allowed: more than 0 and at most 3.75s"),
    (10.0, 0.0, "ha.renew_interval is 0s"),
])
def test_bounds_name_the_setting(ttl, renew, fragment):
    problems = lease_problems(ttl, renew)
    assert problems and fragment in problems[0]
    with pytest.raises(ValueError, match=fragment.split(";")[0]):
        LeaseTiming.from_settings(ttl, renew)


def test_site_config_checks_the_bounds():
    assert HaConfig().etcd is None and HaConfig(lease_ttl=5.0, renew_interval=1.0).lease_ttl == 5.0
    with pytest.raises(ValueError, match="ha.lease_ttl is 0.5s"):
        HaConfig(lease_ttl=0.5)


def test_etcd_settings_one_source():
    from exaserve_hpc.config.schema import EtcdConfig
    assert EtcdConfig(members=3).members == 3
    assert EtcdConfig(endpoints=["http://etcd1:2379"]).endpoints == ["http://etcd1:2379"]
    for bad, match in (({}, "exactly one of members"), ({"members": 2}, "members is 2; allowed: 1, 3 or 5"),
                       ({"members": 3, "endpoints": ["http://a:2379"]}, "exactly one of members")):
        with pytest.raises(ValueError, match=match):
            EtcdConfig(**bad)
    with pytest.raises(ValueError):
        EtcdConfig(endpoints=["etcd1:2379"])
    assert EtcdConfig(members=3).tls is True  # the job's own CA unless turned off
    with pytest.raises(ValueError, match="missing: key_file"):
        EtcdConfig(endpoints=["https://etcd1:2379"], ca_file="ca.crt", cert_file="c.crt")
    with pytest.raises(ValueError, match="name a centre's etcd"):
        EtcdConfig(members=3, ca_file="a", cert_file="b", key_file="c")
