"""The agent supervisor's policy: when a dead agent is not restarted (agent_supervisor.give_up_reason)."""

from exaserve_hpc.app.agent_supervisor import EXIT_BAD_GRANT, RESTARTS, WINDOW, give_up_reason
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


def test_a_replica_that_ended_before_the_scan_is_reaped_by_its_pid():
    """A dead agent's idle replica drains at PDEATHSIG's TERM and ends before the supervisor looks: a zombie
    child whose /proc cmdline is empty, so only its pid (the controller's) names it. A real process here."""
    import os
    import sys
    import time
    from pathlib import Path

    from exaserve_hpc.app.agent_supervisor import end_orphans

    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ))
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 20
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert (Path(f"/proc/{pid}/cmdline")).read_bytes() == b""  # why the scan by command line misses it
    try:
        assert pid in end_orphans(known=[pid, 1])  # 1: not our child, skipped
        assert not stat.exists(), "still a zombie"
    finally:
        if stat.exists():
            os.waitpid(pid, 0)


def test_a_running_replica_the_scan_missed_is_killed_and_reaped_by_its_pid():
    """A dead agent's replica the /proc scan did not name (here: its command line is not a replica's) while
    it still ran: left alone it would drain and stay a zombie; the controller's pid names it."""
    import os
    import sys
    from pathlib import Path

    from exaserve_hpc.app.agent_supervisor import end_orphans

    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    stat = Path(f"/proc/{pid}/stat")
    try:
        assert stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # running
        assert pid in end_orphans(known=[pid])
        assert not stat.exists(), "still running or a zombie"
    finally:
        if stat.exists():
            os.kill(pid, 9)
            os.waitpid(pid, 0)
