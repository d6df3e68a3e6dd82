"""The router's thread leaves a request's prompt encoded: the replica gets the gateway's own bytes first,
a correct re-encoded prompt (with the tokens already sent) on a retry, and the prompt's length counts."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, TokenChunk, decode, encode
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import GATEWAY, REPLICA, Dispatcher, DispatchSettings, attempt_id
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
    assert message.request_id == attempt_id("q", 2)  # a resend's own replica-side id
    [last] = d.on_replica_message(again.peer.decode(), TokenChunk(request_id=message.request_id, token_ids=[1, 2, 3],
                                                                  finished=True), 0.3)
    assert last.message.request_id == "q" and last.message.prompt_tokens == len(PROMPT) and last.message.completion_tokens == 5


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


# ------------------------------------------------------------ packed prompts (what gateways send)

from exaserve_hpc.protocol import pack_request, unpack_hashes  # noqa: E402
from exaserve_hpc.router.affinity import AffinitySettings  # noqa: E402
from exaserve_hpc.router.policies import make_policy  # noqa: E402


@pytest.mark.parametrize("hashes", [[1, -2, 3], [2 ** 63 + 5, 7], []])
def test_a_packed_request_decodes_to_the_same_lists(hashes):
    request = GenerateRequest(request_id="p", model="m", prompt_token_ids=PROMPT, max_tokens=3,
                              prefix_hashes=hashes, prefix_scheme="s" if hashes else "")
    packed = pack_request(request)
    assert packed.prompt_token_ids == [] and packed.prompt_packed and request.prompt_token_ids == PROMPT
    assert bool(packed.hashes_packed) == bool(hashes) and packed.prefix_hashes == []
    assert decode(encode(packed)) == request


def test_token_ids_beyond_uint32_stay_a_list():
    request = GenerateRequest(request_id="p", model="m", prompt_token_ids=[1, 2 ** 32], max_tokens=3)
    assert pack_request(request) is request
    assert decode(encode(pack_request(request))) == request


def test_the_router_reads_a_packed_prompts_length_and_hashes_and_forwards_it_unchanged():
    settings = AffinitySettings(block_size=16)
    hasher = settings.hasher()
    d = Dispatcher(make_policy("prefix_affinity", settings=settings), DispatchSettings(), {"m"})
    for rid in ("r1", "r2", "r3"):
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=1, max_batch_size=4,
                                               max_seq_len=4096), 0.0)
    sent = []
    # Not the router's own hashes of PROMPT: seeing these in the key shows it read the packed ones.
    theirs = [h ^ 0x5A5A for h in hasher(PROMPT)]
    for i in range(2):
        frame = encode(pack_request(GenerateRequest(
            request_id=f"q{i}", model="m", prompt_token_ids=PROMPT, max_tokens=5,
            prefix_hashes=theirs, prefix_scheme=hasher.scheme)))
        view = memoryview(frame)
        routed = _frontend_decoder.decode(view)
        assert len(routed.prompt_token_ids) == len(PROMPT) and list(routed.prompt_token_ids) == PROMPT
        [out] = d.on_request(b"gw", routed, 0.0, view)
        assert bytes(out.message) == frame  # the replica unpacks it (protocol.decode)
        assert list(d.inflight[f"q{i}"].key.block_hashes) == theirs
        sent.append(out.peer)
        chunks = d.on_replica_message(out.peer.decode(), TokenChunk(request_id=f"q{i}", token_ids=[9],
                                                                     finished=i == 0), 0.1)
        assert chunks[0].message.prompt_tokens == len(PROMPT)
    assert sent[0] == sent[1]  # the second found the first's blocks: the hashes were read, not lost
    retried = [o for o in d.replica_lost(sent[0].decode(), "test", 0.2)
               if o.side == REPLICA and isinstance(o.message, GenerateRequest)]
    assert retried and all(o.message.prompt_token_ids[:len(PROMPT)] == PROMPT for o in retried)


def test_malformed_packed_hashes_make_the_router_hash_itself():
    hashes, scheme = unpack_hashes(b"\x00" * 8, "s:q")
    assert (list(hashes), scheme) == ([0], "s")
    assert unpack_hashes(b"\x00" * 7, "s:q") == ([], "")
    assert unpack_hashes(b"\x00" * 8, "s") == ([], "")


def test_a_packed_prompt_of_a_broken_length_is_answered_400_not_left_waiting():
    frame = encode(pack_request(GenerateRequest(request_id="p", model="m", prompt_token_ids=[1, 2], max_tokens=1)))
    routed = _frontend_decoder.decode(frame)
    broken = msgspec.structs.replace(routed, prompt_packed=routed.prompt_packed[:-1])
    with pytest.raises(msgspec.ValidationError, match="not 4 a token id"):
        broken.prompt_token_ids
    d = Dispatcher(RoundRobin(), DispatchSettings(), {"m"})
    [answer] = d.on_request(b"gw", broken, 0.0, memoryview(encode(broken)))
    assert answer.side == GATEWAY and answer.message.status == 400 and answer.message.code == "invalid_request"
    assert "unreadable prompt" in answer.message.message and not d.inflight
    with pytest.raises(msgspec.ValidationError, match="whole number"):
        decode(encode(msgspec.structs.replace(pack_request(GenerateRequest(
            request_id="p", model="m", prompt_token_ids=[1, 2], max_tokens=1)), prompt_packed=b"\x01\x02\x03")))


@pytest.mark.parametrize("hashes_packed, scheme", [(b"\x01" * 7, "s:q"), (b"\x01" * 8, "s"), (b"\x01" * 8, ":q")])
def test_a_replica_takes_a_request_whose_packed_hashes_are_bad(hashes_packed, scheme):
    """The router hashes such a prompt itself and forwards the bytes: the replica must not refuse them."""
    packed = msgspec.structs.replace(pack_request(GenerateRequest(request_id="p", model="m", prompt_token_ids=PROMPT,
                                                                  max_tokens=1)),
                                     hashes_packed=hashes_packed, prefix_scheme=scheme)
    got = decode(encode(packed))
    assert got.prompt_token_ids == PROMPT and got.prefix_hashes == [] and got.prefix_scheme == ""


def test_hashes_without_a_scheme_are_dropped_and_packing_twice_changes_nothing():
    request = GenerateRequest(request_id="p", model="m", prompt_token_ids=[5, 6, 7], max_tokens=1,
                              prefix_hashes=[1, 2, 3])
    once = pack_request(request)
    assert once.hashes_packed == b"" and once.prefix_hashes == [] and once.prefix_scheme == ""
    assert pack_request(once) is once
    assert decode(encode(pack_request(once))).prompt_token_ids == [5, 6, 7]
