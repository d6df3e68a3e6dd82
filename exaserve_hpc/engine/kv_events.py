"""KV-cache events: which prefix blocks a replica holds, for precise routing.

Wire format (the shape vLLM's KV-event publisher uses): each batch is one
ZeroMQ PUB multipart message ``[topic, sequence number (8 bytes, big
endian), payload]``; the payload is a MessagePack ``KVEventBatch``. Block
names are the chained hashes of ``block_manager.hash_block_tokens``, so a
router that hashes a prompt the same way knows which replica holds it.

A subscriber that missed messages sees a gap in the sequence numbers and
should drop what it knows of that replica (``AllBlocksCleared`` is also sent
when the engine shuts down).

Call protocol: ``pub = KVEventPublisher(endpoint, topic, with_tokens=...)``;
``pub.publish(events)`` after each engine step (no-op for an empty list;
never blocks: a slow subscriber loses messages, the engine never waits);
``pub.close()``. ``decode_batch(payload)`` for subscribers.

Privacy: a replica's publishers are CURVE servers (``secure_publishers``, set
by the replica process before its engine is built, from the run's keys): each
replica makes its own key pair, announces the public key in its hello (over
the router's CURVE backend), and its ZAP handler admits only the run's client
key, which the router holds. A subscriber without that key completes no
handshake and receives nothing. The block hashes are keyed with the run's
secret salt (``block_manager.set_block_hash_salt``).
"""

from __future__ import annotations

from typing import Union

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    block_hashes: list[int]          # consecutive blocks of one sequence, in order
    parent_block_hash: int | None    # hash of the block before the first; None at the start
    token_ids: list[int]             # len(block_hashes) * block_size ids; [] from a publisher that withholds
    #                                  prompts (replicas do, CURVE or not: the router needs only hashes)
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[int]          # evicted: no longer reusable on this replica


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, frozen=True):
    ts: float                        # publisher's wall clock, seconds since the epoch
    events: list[KVEvent]
    replica_id: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError for a payload that is not a KVEventBatch."""
    return _DECODER.decode(payload)
