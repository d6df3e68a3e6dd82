"""Routing policies behind one declared interface, built by one factory from the site's router section."""

from __future__ import annotations

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.engine.kv_events import BlockStored
from exaserve_hpc.protocol import ReplicaHello
from exaserve_hpc.router.balancing import Decision, ReplicaLoad, RoutingPolicy
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.policies import POLICY_NAMES, make_policy, policy_for_site


def site_with(**router):
    return parse_site({"site": "t", "models": [{"model_name": "m"}], "router": router})


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_name_builds_a_routing_policy_from_the_site(name):
    site = site_with(policy=name)
    policy = policy_for_site(site.router, site.batching)
    assert isinstance(policy, RoutingPolicy) and policy.name == name
    loads = [ReplicaLoad(f"r{i}", "m", i, 8) for i in range(3)]
    decision = policy.route(loads, {"r0"}, policy.routing_key([1] * 40) if policy.uses_prefix else None)
    assert isinstance(decision, Decision) and decision.replica_id in ("r1", "r2")
    assert policy.route(loads, {"r0", "r1", "r2"}, None).replica_id is None
    assert not policy.follows_kv_events  # approximate is the default


def test_a_policy_without_route_cannot_exist():
    class Half(RoutingPolicy):
        name = "half"

    with pytest.raises(TypeError, match="route"):
        Half()
    with pytest.raises(ValueError, match="unknown routing policy 'nope'; choose one of round_robin, least_load"):
        make_policy("nope")


def test_only_a_precise_policy_follows_kv_events_through_the_dispatcher():
    hashes = [11, 12]
    stored = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16)]
    for mode, follows in (("approximate", False), ("precise", True)):
        site = site_with(policy="prefix_affinity", prefix_mode=mode)
        d = Dispatcher(policy_for_site(site.router, site.batching), DispatchSettings(), {"m"})
        assert d.follows_kv_events is follows
        d.register("r1", ReplicaHello(replica_id="r1", model="m", pid=1, max_batch_size=8, max_seq_len=64), 0.0)
        d.on_kv_events("r1", stored)
        assert dict(d.policy.index.match(hashes)).get("r1", 0) == (2 if follows else 0)


def test_a_precise_router_warns_once_when_the_engines_block_size_differs(caplog):
    site = site_with(policy="prefix_affinity", prefix_mode="precise", block_size=32)
    policy = policy_for_site(site.router, site.batching)
    stored = [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=16)]
    with caplog.at_level("WARNING"):
        policy.on_kv_events("r1", stored)
        policy.on_kv_events("r2", stored)
    warnings = [r.getMessage() for r in caplog.records if "router.block_size" in r.getMessage()]
    assert warnings == ["replica r1 caches blocks of 16 tokens but router.block_size is 32: precise prefix routing "
                        "will find no match; set router.block_size to 16"]


def test_gateways_hash_prompts_as_the_routers_policy_does():
    from exaserve_hpc.router.policies import policy_class
    assert policy_class("least_load").prompt_hasher(site_with().router) is None
    site = site_with(policy="prefix_affinity", prefix_mode="precise", block_size=32)
    policy = policy_for_site(site.router, site.batching)
    hasher = policy_class("prefix_affinity").prompt_hasher(site.router)
    assert hasher.scheme == policy.hasher.scheme and hasher([1] * 64) == policy.routing_key([1] * 64).block_hashes


def test_least_tokens_counts_outstanding_prefill_and_decode_tokens_through_the_dispatcher():
    """The token-aware baseline: one long prompt outweighs several short chats; the dispatcher
    charges a request's uncached prompt until its first token and its max_tokens until it ends."""
    from exaserve_hpc.protocol import GenerateRequest, TokenChunk

    d = Dispatcher(make_policy("least_tokens"), DispatchSettings(), {"m"})
    for rid in ("a", "b"):
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=0, max_batch_size=8,
                                               max_seq_len=40000), 0.0)

    def send(i, prompt, max_tokens):
        out = d.on_request(b"gw", GenerateRequest(request_id=f"q{i}", model="m", prompt_token_ids=[1] * prompt,
                                                  max_tokens=max_tokens), 0.0)
        return out[0].peer.decode()

    first = send(0, 30000, 10)
    shorts = [send(i, 100, 10) for i in range(1, 6)]
    assert set(shorts) == {"a", "b"} - {first}   # 5 chats beside one long prompt: requests would alternate
    other = d.replicas[shorts[0]].load
    assert (other.prefill_tokens, other.decode_tokens, other.outstanding) == (500, 50, 5)
    d.on_replica_message(first, TokenChunk(request_id="q0", token_ids=[5]), 0.1)
    assert d.replicas[first].load.prefill_tokens == 0 and d.replicas[first].load.decode_tokens == 10
    d.on_replica_message(first, TokenChunk(request_id="q0", token_ids=[5], finished=True, finish_reason="length"), 0.2)
    assert (d.replicas[first].load.prefill_tokens, d.replicas[first].load.decode_tokens) == (0, 0)
    loads = [ReplicaLoad("x", "m", 0, 8, prefill_tokens=900), ReplicaLoad("y", "m", 3, 8, prefill_tokens=300,
                                                                          decode_tokens=500)]
    assert make_policy("least_tokens").route(loads).replica_id == "y"
    assert make_policy("least_load").route(loads).replica_id == "x"
