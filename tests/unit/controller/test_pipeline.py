"""The controller's side of pipeline-parallel replicas, driven through its handler (no sockets): one
StartReplica per stage, the stages' rendezvous, a failed stage failing its attempt, and a lost node
moving the whole replica to a new attempt on live nodes."""

from __future__ import annotations

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.protocol import AgentHello, MemoryPoolStatus, ReplicaEvent, StageHello, StageTable, StartReplica
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.core import ControllerCore
from exaserve_hpc.controller.stage_rendezvous import PipelineStages, stage_of, stage_process_id

GiB = 1 << 30


class StubRouter(RouterPortStub):
    backend_endpoint = "tcp://127.0.0.1:1"
    frontend_endpoint = "tcp://127.0.0.1:2"

    def __init__(self):
        self.lost: list[str] = []

    def snapshot(self) -> dict:
        return {"replicas": []}

    def replica_lost(self, replica_id: str, why: str) -> None:
        self.lost.append(replica_id)

    def drain(self, replica_id: str) -> None:
        pass


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def pp_controller(tmp_path):
    site = parse_site({
        "site": "pp3", "run_dir": str(tmp_path / "run"),
        "cluster": {"nodes": 3, "nodelist": "n[1-3]", "gpus_per_node": 0, "fault_groups": {"rack": "n[1-3]"}},
        "scheduler": {"cooldown_period": 3600, "min_replicas_per_model": 1},
        "weight_cache": {"l3_path": str(tmp_path / "models")},
        "models": [{"model_name": "pp", "engine": "echo", "replicas": 1, "min_replicas": 1,
                    "pipeline_parallel": 2}],
    })
    clock = Clock()
    ctl = ControllerCore(site, StubRouter(), clock=clock, expected_agents=["n1", "n2", "n3"])
    ctl.fleet.pipelines.rendezvous = "tcp://ctl:5555"
    for node in ("n1", "n2", "n3"):
        ctl.handle(node, AgentHello(agent_id=node, hostname=node, pid=1, host_memory_total=64 * GiB,
                                    memory=MemoryPoolStatus(block_size=GiB, total=[32 * GiB], free=[32 * GiB])))
    return ctl, clock, site


def sent_starts(ctl) -> list[tuple[str, StartReplica]]:
    return [(node, m) for node, m in ctl.fleet.take_outbox() if isinstance(m, StartReplica)]


def test_stage_ids_name_the_replica_rank_and_attempt():
    assert stage_process_id("m/r0003", 0, 7) == "m/r0003"
    assert stage_process_id("m/r0003", 2, 7) == "m/r0003~s2@7"
    assert stage_of("m/r0003~s2@7") == ("m/r0003", 2, 7)
    assert stage_of("m/r0003") is None and stage_of("m/r0003~sx@1") is None


def test_a_replica_of_one_stage_is_sent_as_it_is():
    spec = StartReplica(replica_id="m/r0000", model="m", model_dir="-", router_backend="tcp://r:1")
    assert PipelineStages().stage_starts([("n1", spec)]) == [("n1", spec)]


def test_each_stage_gets_its_start_on_its_node_and_they_meet_through_the_controller(tmp_path):
    ctl, _, site = pp_controller(tmp_path)
    starts = sent_starts(ctl)
    assert len(starts) == 2
    (node0, s0), (node1, s1) = starts
    assert node0 != node1  # the planner's stages: distinct nodes of one fault group
    assert (s0.replica_id, s1.replica_id) == ("pp/r0000", "pp/r0000~s1@1")
    assert ctl.replicas["pp/r0000"].agent_id == node0  # the record is stage 0's
    for rank, spec in enumerate((s0, s1)):
        assert spec.stage.rank == rank and spec.stage.size == 2 and spec.stage.key == "pp/r0000@1"
        assert spec.stage.nodes == [node0, node1] and spec.stage.rendezvous == "tcp://ctl:5555"
        assert spec.stage.timeout == site.heartbeat.expiry

    def hello(rank: int, endpoint: str) -> StageTable:
        ctl.handle(f"stage/{rank}", StageHello(key="pp/r0000@1", rank=rank, endpoint=endpoint))
        ((peer, table),) = [(p, m) for p, m in ctl.fleet.take_outbox() if isinstance(m, StageTable)]
        assert peer == f"stage/{rank}"  # the answer goes to the stage process that asked
        return table

    assert hello(1, "tcp://b:7001").endpoints == ["", "tcp://b:7001"]
    table = hello(0, "tcp://a:7000")
    assert table.endpoints == ["tcp://a:7000", "tcp://b:7001"] and not table.failed

    # A later stage's events are not the replica's: a failure fails the attempt, and its waiting peers learn why.
    ctl.handle(node1, ReplicaEvent(agent_id=node1, replica_id="pp/r0000~s1@1", state="failed",
                                   detail="reserve failed: 40 GiB asked"))
    assert ctl.replicas["pp/r0000"].state.value == "pending"
    assert hello(0, "tcp://a:7000").failed == f"stage 1 on node {node1} failed: reserve failed: 40 GiB asked"


def test_a_lost_stage_node_moves_the_whole_replica_to_a_new_attempt(tmp_path):
    ctl, clock, site = pp_controller(tmp_path)
    (node0, _), (node1, _) = sent_starts(ctl)
    ctl.handle(node0, ReplicaEvent(agent_id=node0, replica_id="pp/r0000", state="serving"))
    clock.now += site.heartbeat.expiry + site.heartbeat.loss_grace + 1  # suspected, then lost
    for node in ("n1", "n2", "n3"):  # every node but the stage-1 node was heard from lately
        if node != node1:
            ctl.agents[node].last_seen = clock.now
    ctl.tick(clock.now)
    assert "pp/r0000" in ctl.router.lost  # out of routing at once
    starts = sent_starts(ctl)
    assert [s.stage.key for _, s in starts] == ["pp/r0000@2"] * 2  # both stages: one new attempt
    assert node1 not in [node for node, _ in starts] and len({node for node, _ in starts}) == 2
    assert starts[1][1].replica_id == "pp/r0000~s1@2"
    # Stages of the replaced attempt that still ask are told to go.
    ctl.handle("stage/old", StageHello(key="pp/r0000@1", rank=0, endpoint="tcp://a:7000"))
    (table,) = [m for _, m in ctl.fleet.take_outbox() if isinstance(m, StageTable)]
    assert table.failed == "replaced by attempt pp/r0000@2"
