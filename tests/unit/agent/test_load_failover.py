"""after_load_failure: where the controller restarts a replica whose weights did not load."""

from exaserve_hpc.agent.load_failover import NodeView, after_load_failure
from exaserve_hpc.protocol import LoadFailed

GB = 1 << 30


def failed(reason="load_timeout", agent="n1"):
    return LoadFailed(agent_id=agent, replica_id="r1", model="m", reason=reason, attempts=4)


def test_a_timeout_moves_the_replica_to_a_node_that_has_the_model_in_l2():
    nodes = [NodeView("n1", 0, 80 * GB), NodeView("n2", 1, 80 * GB),
             NodeView("n3", 3, 20 * GB, frozenset({"m"}))]
    decision = after_load_failure(failed(), nodes, {"n1"}, needed_bytes=16 * GB)
    assert decision.agent_id == "n3" and decision.why.startswith("l2-hit")


def test_otherwise_the_node_with_most_free_memory_then_fewest_replicas():
    nodes = [NodeView("n2", 1, 40 * GB), NodeView("n3", 0, 40 * GB), NodeView("n4", 0, 10 * GB)]
    assert after_load_failure(failed(), nodes, {"n1"}, 16 * GB).agent_id == "n3"
    assert after_load_failure(failed(), nodes, {"n1", "n3", "n2"}, 16 * GB).agent_id is None


def test_a_bad_checkpoint_is_not_retried_anywhere():
    decision = after_load_failure(failed("checksum"), [NodeView("n2", 0, 80 * GB)], {"n1"})
    assert decision.agent_id is None and "repair" in decision.why
