"""The router's thread leaves a request's prompt encoded: the replica gets the gateway's own bytes first,
a correct re-encoded prompt (with the tokens already sent) on a retry, and the prompt's length counts."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, TokenChunk, decode, encode
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import GATEWAY, REPLICA, Dispatcher, DispatchSettings
from exaserve_hpc.router.dispatch_state import PromptTokens, RoutedRequest, array_length
from exaserve_hpc.router.zmq_router import ZmqRouter, _frontend_decoder

PROMPT = list(range(1000, 1300)) + [70000, 5]


def test_routed_request_has_every_field_of_generate_request_under_the_same_names():
    ours = [(f.encode_name, f.required) for f in msgspec.structs.fields(RoutedRequest)]
    theirs = [(f.encode_name, f.required) for f in msgspec.structs.fields(GenerateRequest)]
    assert ours == theirs


@pytest.mark.parametrize("n", [0, 1, 15, 16, 300, 70000])
def test_prompt_length_read_from_the_array_header(n):
    raw = _frontend_decoder.decode(encode(GenerateRequest(request_id="a", model="m", prompt_token_ids=[7] * n,
                                                          max_tokens=1))).prompt
    assert array_length(raw) == n
    tokens = PromptTokens(raw)
    assert len(tokens) == n and list(tokens) == [7] * n and tokens[:3] == [7] * min(3, n)


def test_a_prompt_that_is_not_an_array_is_refused():
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids must be an array"):
        array_length(msgspec.msgpack.encode("nope"))


def test_first_attempt_forwards_the_gateway_bytes_and_a_retry_re_encodes_prompt_plus_sent_tokens():
    frame = encode(GenerateRequest(request_id="q", model="m", prompt_token_ids=PROMPT, max_tokens=5, seed=3,
                                   temperature=0.5))
    d = Dispatcher(RoundRobin(), DispatchSettings(), {"m"})
    for rid in ("r1", "r2"):
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=4,
                                               max_seq_len=4096), 0.0)
    view = memoryview(frame)
    [out] = d.on_request(b"gw", _frontend_decoder.decode(view), 0.0, view)
    assert out.side == REPLICA and bytes(out.message) == frame
    first = out.peer.decode()
    [chunk] = d.on_replica_message(first, TokenChunk(request_id="q", token_ids=[9, 8]), 0.1)
    assert chunk.side == GATEWAY and chunk.message.prompt_tokens == len(PROMPT)
    retried = [o for o in d.replica_lost(first, "test", 0.2) if o.side == REPLICA and o.peer.decode() != first]
    [again] = retried
    message = again.message
    assert isinstance(message, GenerateRequest)
    assert message.prompt_token_ids == PROMPT + [9, 8] and message.max_tokens == 3 and message.resumed_tokens == 2
    assert (message.seed, message.temperature) == (3, 0.5)
    [last] = d.on_replica_message(again.peer.decode(), TokenChunk(request_id="q", token_ids=[1, 2, 3],
                                                                  finished=True), 0.3)
    assert last.message.prompt_tokens == len(PROMPT) and last.message.completion_tokens == 5


def test_through_the_real_router_the_replica_receives_the_request_byte_for_byte():
    ctx = zmq.Context()
    router = ZmqRouter(Dispatcher(RoundRobin(), DispatchSettings(), {"m"}), context=ctx).start()
    try:
        replica = ctx.socket(zmq.DEALER)
        replica.setsockopt(zmq.IDENTITY, b"r1")
        replica.connect(router.backend_endpoint)
        replica.send(encode(ReplicaHello(replica_id="r1", model="m", pid=1, max_batch_size=4, max_seq_len=4096)))
        gateway = ctx.socket(zmq.DEALER)
        gateway.connect(router.frontend_endpoint)
        frame = encode(GenerateRequest(request_id="q", model="m", prompt_token_ids=PROMPT, max_tokens=2,
                                       prefix_hashes=[1, 2, 3], prefix_scheme="other"))
        for _ in range(50):  # until the hello is in: before that the request waits (also fine)
            if router.snapshot()["replicas"]:
                break
            replica.poll(100)
        gateway.send(frame)
        assert replica.poll(5000)
        assert replica.recv() == frame
        replica.send(encode(TokenChunk(request_id="q", token_ids=[4, 5], finished=True, finish_reason="length")))
        assert gateway.poll(5000)
        reply = decode(gateway.recv())
        assert reply.finished and reply.prompt_tokens == len(PROMPT) and reply.token_ids == [4, 5]
    finally:
        router.stop()
        ctx.destroy(linger=0)
