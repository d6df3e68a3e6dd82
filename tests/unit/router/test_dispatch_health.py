"""Dispatcher with breakers, stalled streams and prefix affinity (no sockets)."""

from __future__ import annotations

from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, RequestError, TokenChunk
from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
from exaserve_hpc.router.balancing import LeastLoad, WeightSettings
from exaserve_hpc.router.breaker import BreakerSettings
from exaserve_hpc.router.dispatch import REPLICA, Dispatcher, DispatchSettings, attempt_id

GW = b"gw"


def make(policy=None, **kw) -> Dispatcher:
    kw.setdefault("breaker", BreakerSettings(failures=2, cooloff=10))
    settings = DispatchSettings(max_attempts=3, first_token_timeout=5, replica_expiry=1000, request_timeout=600, **kw)
    return Dispatcher(policy or LeastLoad(), settings, {"m"})


def hello(d, rid, now=0.0, batch=8):
    d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=batch,
                                           max_seq_len=4096), now)


def req(rid, prompt=(1, 2, 3), max_tokens=5):
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=list(prompt), max_tokens=max_tokens)


def targets(out):
    return [o.peer.decode() for o in out if o.side == REPLICA and isinstance(o.message, GenerateRequest)]


def fail(d, rid, replica, now):
    return d.on_replica_message(replica, RequestError(request_id=rid, status=500, code="engine_error",
                                                      message="boom"), now)


def open_breaker(d):
    for i in range(2):
        d.on_request(GW, req(f"a{i}"), i)
        fail(d, f"a{i}", "bad", i)
        d.on_replica_message("good", TokenChunk(request_id=attempt_id(f"a{i}", 2), token_ids=[1], finished=True),
                             i + 0.5)
    assert "bad" in d.unavailable


def test_consecutive_failures_open_the_breaker_and_take_the_replica_out():
    d = make()
    hello(d, "bad")
    hello(d, "good")
    d.replicas["good"].load.outstanding = 5  # least-load would prefer "bad"
    for i in range(2):
        [t] = targets(d.on_request(GW, req(f"a{i}"), i))
        assert t == "bad"
        [retry] = targets(fail(d, f"a{i}", "bad", i + 0.1))
        assert retry == "good"
    assert d.snapshot()["breaker_opened"] == 1
    assert "bad" in d.unavailable
    assert targets(d.on_request(GW, req("b"), 3)) == ["good"]


def test_half_open_probe_then_closed_on_first_token():
    d = make()
    hello(d, "bad")
    hello(d, "good")
    d.replicas["good"].load.outstanding = 5
    open_breaker(d)
    d.tick(11)  # cool-off over: half-open
    assert "bad" not in d.unavailable
    [t] = targets(d.on_request(GW, req("probe"), 11.1))
    assert t == "bad"
    assert targets(d.on_request(GW, req("other"), 11.2)) == ["good"]  # only one probe at a time
    d.on_replica_message("bad", TokenChunk(request_id="probe", token_ids=[7]), 11.3)
    assert d.replicas["bad"].breaker.state.value == "closed" and "bad" not in d.unavailable


def test_failed_probe_reopens():
    d = make()
    hello(d, "bad")
    hello(d, "good")
    d.replicas["good"].load.outstanding = 5
    open_breaker(d)
    d.tick(11)
    d.on_request(GW, req("probe"), 11.1)
    fail(d, "probe", "bad", 11.2)
    assert d.replicas["bad"].breaker.state.value == "open" and "bad" in d.unavailable
    d.tick(25)  # doubled cool-off (20 s) not over yet
    assert "bad" in d.unavailable


def test_first_token_timeout_counts_against_the_breaker_and_moves_the_request():
    d = make()
    hello(d, "slow")
    d.on_request(GW, req("a"), 0)
    hello(d, "ok")
    out = d.tick(6)
    assert targets(out) == ["ok"]
    assert d.replicas["slow"].breaker.consecutive_failures == 1


def test_a_stream_that_stalls_mid_way_moves_with_its_tokens():
    d = make(stall_timeout=3)
    hello(d, "r1")
    d.on_request(GW, req("a", max_tokens=10), 0)
    hello(d, "r2")
    d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[7, 8]), 1)
    assert targets(d.tick(3.5)) == []
    out = d.tick(4.5)
    [(peer, resumed)] = [(o.peer.decode(), o.message) for o in out
                         if o.side == REPLICA and isinstance(o.message, GenerateRequest)]
    assert peer == "r2" and resumed.prompt_token_ids == [1, 2, 3, 7, 8] and resumed.max_tokens == 8


def test_draining_error_retries_without_counting_as_a_failure():
    d = make()
    hello(d, "r1")
    hello(d, "r2")
    d.on_request(GW, req("a"), 0)
    first = d.inflight["a"].replica_id
    out = d.on_replica_message(first, RequestError(request_id="a", status=503, code="draining", message="bye"), 0.1)
    assert targets(out) and d.replicas[first].breaker.consecutive_failures == 0


def test_reregistered_replica_starts_cold_in_the_prefix_index():
    p = PrefixAffinity(AffinitySettings(block_size=4, weights=WeightSettings(explore=0)), seed=1)
    d = make(p)
    hello(d, "r1")
    hello(d, "r2")
    prompt = list(range(40))
    [first] = targets(d.on_request(GW, req("a", prompt), 0))
    d.on_replica_message(first, TokenChunk(request_id="a", token_ids=[1], finished=True), 0.1)
    [again] = targets(d.on_request(GW, req("b", prompt + [99] * 8), 0.2))
    assert again == first and d.snapshot()["routing"]["affinity"] == 1
    d.on_replica_message(first, TokenChunk(request_id="b", token_ids=[1], finished=True), 0.3)
    hello(d, first, 0.4)  # restarted: same id, empty cache
    d.on_request(GW, req("c", prompt), 0.5)
    assert d.snapshot()["routing"].get("affinity") == 1


def test_prefill_estimate_is_charged_until_the_first_token():
    p = PrefixAffinity(AffinitySettings(block_size=4, weights=WeightSettings(explore=0)), seed=1)
    d = make(p)
    hello(d, "r1")
    d.on_request(GW, req("a", list(range(40))), 0)
    assert d.replicas["r1"].load.prefill_tokens == 40
    d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[1]), 0.1)
    assert d.replicas["r1"].load.prefill_tokens == 0
    d.on_replica_message("r1", TokenChunk(request_id="a", token_ids=[1], finished=True), 0.2)
    d.on_request(GW, req("b", list(range(40)) + [5] * 4), 0.3)
    assert d.replicas["r1"].load.prefill_tokens == 4  # 10 cached blocks of 4: only the tail
    d.on_abort("b")
    assert d.replicas["r1"].load.prefill_tokens == 0 and d.replicas["r1"].load.outstanding == 0


def test_replicas_falling_silent_together_are_all_out_before_their_requests_move():
    """A node's replicas expire in the same tick: a request moved off one must not go to another of them."""
    settings = DispatchSettings(max_attempts=2, first_token_timeout=5, replica_expiry=10, request_timeout=600)
    d = Dispatcher(LeastLoad(), settings, {"m"})
    for rid in ("a-dead", "b-dead", "live"):
        hello(d, rid)
    d.replicas["live"].load.outstanding = 6  # least-load prefers either dead replica while it is listed
    d.replicas["b-dead"].load.outstanding = 1
    [first] = targets(d.on_request(GW, req("r1"), 1.0))
    assert first == "a-dead"
    d.on_replica_message("live", TokenChunk(request_id="none", token_ids=[]), 20.0)  # only "live" is heard
    out = d.tick(20.0)
    assert targets(out) == ["live"]
    assert not [o for o in out if isinstance(o.message, RequestError)]
