"""The router's bookkeeping, driven without sockets: every accepted request is answered exactly once."""

from __future__ import annotations

from exaserve_hpc.protocol import (
    Abort, GenerateRequest, ReplicaBye, ReplicaHello, ReplicaStats, RequestError, TokenChunk,
)
from exaserve_hpc.router.balancing import LeastLoad, ReplicaLoad, RoundRobin
from exaserve_hpc.router.dispatch import GATEWAY, REPLICA, Dispatcher, DispatchSettings, attempt_id

GW = b"gw1"


def make(settings: DispatchSettings | None = None) -> Dispatcher:
    return Dispatcher(LeastLoad(), settings or DispatchSettings(max_attempts=3, first_token_timeout=5,
                                                                 replica_expiry=3, request_timeout=60), {"m"})


def hello(d: Dispatcher, rid: str, now: float = 0.0, batch: int = 4):
    return d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=batch,
                                                  max_seq_len=512), now)


def req(rid: str = "q1", prompt=(256, 1, 2), max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=list(prompt), max_tokens=max_tokens)


def to_gateway(out):
    return [o.message for o in out if o.side == GATEWAY]


def to_replica(out):
    return [(o.peer.decode(), o.message) for o in out if o.side == REPLICA]


def test_unknown_model_is_404_naming_served_models():
    d = make()
    out = d.on_request(GW, GenerateRequest(request_id="x", model="nope", prompt_token_ids=[1], max_tokens=1), 0)
    [err] = to_gateway(out)
    assert isinstance(err, RequestError) and err.status == 404 and err.message.endswith("served models: m")
    assert not d.inflight


def test_request_waits_for_a_replica_then_goes_to_the_least_loaded():
    d = make()
    assert d.on_request(GW, req("a"), 0) == []
    assert d.pending
    sent = to_replica(hello(d, "r1", 0.1))
    assert sent == [("r1", req("a"))]
    hello(d, "r2", 0.2)
    [(target, _)] = to_replica(d.on_request(GW, req("b"), 0.3))
    assert target == "r2"  # r1 has one outstanding


def test_chunks_are_forwarded_and_finish_releases_the_replica():
    d = make()
    hello(d, "r1")
    d.on_request(GW, req("a"), 0)
    out = d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[7, 8]), 0.1)
    [chunk] = to_gateway(out)
    assert chunk.token_ids == [7, 8] and chunk.completion_tokens == 2 and chunk.prompt_tokens == 3
    out = d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[9], finished=True,
                                                finish_reason="length"), 0.2)
    [last] = to_gateway(out)
    assert last.finished and last.completion_tokens == 3
    assert not d.inflight and d.replicas["r1"].load.outstanding == 0
    assert d.counters["completed"] == 1


def test_replica_lost_mid_stream_resumes_on_another_with_tokens_already_sent():
    d = make()
    hello(d, "r1")
    d.on_request(GW, req("a", max_tokens=5), 0)
    hello(d, "r2")
    d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[7, 8]), 0.1)
    out = d.replica_lost("r1", "killed", 0.2)
    # The lost replica is told to abort (it may still run it: a false loss); the resend has its own id.
    [(aborted, abort), (target, resumed)] = to_replica(out)
    assert (aborted, type(abort).__name__, abort.request_id) == ("r1", "Abort", "a")
    assert target == "r2" and resumed.request_id == attempt_id("a", 2) != "a"
    assert resumed.prompt_token_ids == [256, 1, 2, 7, 8]
    assert resumed.max_tokens == 3 and resumed.resumed_tokens == 2
    # The old replica's late chunks are ignored; the new one's are forwarded with the totals.
    assert to_gateway(d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[99]), 0.3)) == []
    [chunk] = to_gateway(d.on_replica_message("r2", TokenChunk(request_id=resumed.request_id, token_ids=[9, 10, 11],
                                                                finished=True, finish_reason="length"), 0.4))
    assert chunk.completion_tokens == 5 and chunk.prompt_tokens == 3 and chunk.finished
    assert chunk.request_id == "a" and not d.attempts
    assert d.counters["retries"] == 1


def test_silent_replica_expires_and_its_requests_move():
    d = make()
    hello(d, "r1", 0)
    hello(d, "r2", 0)
    d.on_request(GW, req("a"), 0)
    [(first, _)] = [(o.peer.decode(), o.message) for o in d.on_request(GW, req("b"), 0) if o.side == REPLICA]
    # Only the replica that did not get "b" keeps reporting.
    other = "r1" if first == "r2" else "r2"
    d.on_replica_message(other, ReplicaStats(replica_id=other), 2.9)
    out = d.tick(3.5)
    assert first not in d.replicas
    assert (attempt_id("b", 2) in {m.request_id for _, m in to_replica(out) if isinstance(m, GenerateRequest)})


def test_attempts_are_bounded_then_a_clear_503():
    d = make(DispatchSettings(max_attempts=2, first_token_timeout=5, replica_expiry=3))
    hello(d, "r1")
    hello(d, "r2")
    d.on_request(GW, req("a"), 0)
    first = d.inflight["a"].replica_id
    d.replica_lost(first, "boom", 0.1)
    second = d.inflight["a"].replica_id
    out = d.replica_lost(second, "boom again", 0.2)
    [err] = to_gateway(out)
    assert err.status == 503 and "2 replica(s)" in err.message and "boom again" in err.message
    assert not d.inflight


def test_client_error_from_replica_is_not_retried():
    d = make()
    hello(d, "r1")
    hello(d, "r2")
    d.on_request(GW, req("a"), 0)
    rid = d.inflight["a"].replica_id
    out = d.on_replica_message(rid, RequestError(request_id="a", status=400, code="invalid_request",
                                                 message="too long"), 0.1)
    [err] = to_gateway(out)
    assert err.status == 400 and err.message == "too long"
    assert d.counters["retries"] == 0


def test_no_replica_within_first_token_timeout_is_503():
    d = make()
    d.on_request(GW, req("a"), 0)
    assert d.snapshot()["pending_by_model"] == {"m": 1}  # the demand the autoscaler sees
    assert to_gateway(d.tick(4.0)) == []
    [err] = to_gateway(d.tick(5.5))
    assert d.snapshot()["pending_by_model"] == {}
    assert err.status == 503 and err.code == "no_replica" and err.retry_after > 0


def test_deadline_is_504_and_aborts_on_the_replica():
    d = make(DispatchSettings(request_timeout=10, first_token_timeout=100, replica_expiry=100))
    hello(d, "r1")
    d.on_request(GW, req("a"), 0)
    d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[1]), 1)
    out = d.tick(10.5)
    [err] = to_gateway(out)
    assert err.status == 504
    assert ("r1", Abort(request_id="a")) in to_replica(out)


def test_gateway_abort_reaches_the_replica_and_frees_it():
    d = make()
    hello(d, "r1")
    d.on_request(GW, req("a"), 0)
    out = d.on_abort("a")
    assert to_replica(out) == [("r1", Abort(request_id="a"))]
    assert d.replicas["r1"].load.outstanding == 0 and not d.inflight


def test_bye_takes_replica_out_and_draining_replica_gets_no_new_work():
    d = make()
    hello(d, "r1")
    hello(d, "r2")
    d.drain("r1")
    for i in range(3):
        [(target, _)] = to_replica(d.on_request(GW, req(f"q{i}"), 0))
        assert target == "r2"
    d.on_replica_message("r2", ReplicaBye(replica_id="r2"), 1)
    assert "r2" not in d.replicas


def test_least_load_and_round_robin_policies():
    loads = [ReplicaLoad("a", "m", 3, 4), ReplicaLoad("b", "m", 1, 4), ReplicaLoad("c", "m", 1, 4, kv_used=0.5)]
    assert LeastLoad().choose(loads) == "b"
    assert LeastLoad().choose(loads, frozenset({"b"})) == "c"
    rr = RoundRobin()
    assert [rr.choose(loads) for _ in range(4)] == ["a", "b", "c", "a"]
    assert LeastLoad().choose([]) is None


def test_a_replicas_reported_latency_reaches_its_models_pool_and_its_versions_pool():
    """Both sums move: the version pool (canary rollouts weigh latency there) once stayed at 0 because the
    model pool's update had already changed the replica's value when the version pool took the difference."""
    d = Dispatcher(RoundRobin(), DispatchSettings(), {"m"})
    for rid, latency in (("m/r0", 30.0), ("m/r1", 10.0)):
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=4, max_seq_len=64,
                                               version="v2"), 0.0)
        d.on_replica_message(rid, ReplicaStats(replica_id=rid, latency_ewma_ms=latency), 0.0)
    d.on_replica_message("m/r0", ReplicaStats(replica_id="m/r0", latency_ewma_ms=50.0), 1.0)
    assert d.pools["m"].mean_latency_ms == d.version_pools[("m", "v2")].mean_latency_ms == 30.0
    d.on_replica_message("m/r0", ReplicaBye(replica_id="m/r0"), 2.0)  # leaving takes its own value out of both
    assert d.pools["m"].mean_latency_ms == d.version_pools[("m", "v2")].mean_latency_ms == 10.0
