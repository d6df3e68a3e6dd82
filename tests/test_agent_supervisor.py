"""The agent supervisor's policy: when a dead agent is not restarted (agent_supervisor.give_up_reason)."""

from exaserve_hpc.agent_supervisor import EXIT_BAD_GRANT, RESTARTS, WINDOW, give_up_reason
from exaserve_hpc.agent.node_agent import EXIT_BAD_GRANT as AGENT_BAD_GRANT


def test_a_killed_agent_is_restarted_until_it_dies_too_often():
    assert give_up_reason(-9, [], 100.0) == ""
    assert give_up_reason(3, [100.0 - WINDOW - 1] * 10, 100.0) == ""  # old restarts do not count
    recent = [99.0] * RESTARTS
    assert "not restarting" in give_up_reason(-9, recent, 100.0)
    assert give_up_reason(-9, recent[1:], 100.0) == ""


def test_an_agent_refusing_the_node_is_not_restarted():
    assert EXIT_BAD_GRANT == AGENT_BAD_GRANT
    assert "status 2" in give_up_reason(EXIT_BAD_GRANT, [], 0.0)
