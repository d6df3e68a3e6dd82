"""A local user without the run's keys, against the ZeroMQ sockets of a running `exaserve serve`.

    python attacker.py MODE ENDPOINT [SERVER_PUBLIC_KEY] [ARG]

Run by tests/security/test_serve_sockets.py as another uid (setpriv). Modes: generate (send a GenerateRequest
to the router frontend and wait for any reply), replica (register as a replica at the router backend and
wait for requests), agent (say hello to the controller as an agent), abort (abort request ARG at the
frontend). With SERVER_PUBLIC_KEY the client speaks CURVE with a key pair of its own (the worst case: it
learnt the server's public key), else plain. Prints one JSON line: what came back.
"""

import json
import os
import sys
import time

import zmq

from exaserve_hpc.protocol import Abort, AgentHello, GenerateRequest, ReplicaHello, decode, encode


def main() -> None:
    mode, endpoint = sys.argv[1], sys.argv[2]
    server_key = sys.argv[3] if len(sys.argv) > 3 else ""
    arg = sys.argv[4] if len(sys.argv) > 4 else ""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    model, _, identity = arg.partition(",")  # replica: MODEL,REPLICA_ID (a real replica's id: a takeover)
    identity = identity or "evil-replica"
    sock.setsockopt(zmq.IDENTITY, {"replica": identity.encode(), "agent": b"evil-agent"}.get(mode, b"evil-client"))
    if server_key:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key.encode(), public, secret
    sock.connect(endpoint)
    if mode == "generate":
        message = GenerateRequest(request_id="evil-1", model=arg, prompt_token_ids=[1, 2, 3], max_tokens=4)
    elif mode == "replica":
        message = ReplicaHello(replica_id=identity, model=model, pid=os.getpid(), max_batch_size=8,
                               max_seq_len=4096)
    elif mode == "agent":
        message = AgentHello(agent_id="evil-agent", hostname="evil", pid=os.getpid())
    else:
        message = Abort(request_id=arg)
    received = []
    deadline = time.monotonic() + 4.0
    sent = 0
    while time.monotonic() < deadline:
        if sent < 4:  # a few times: a refused handshake is retried by libzmq
            try:
                sock.send(encode(message), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
        if sock.poll(250):
            received.append(type(decode(sock.recv())).__name__)
    print(json.dumps({"mode": mode, "sent": sent, "received": received}), flush=True)


if __name__ == "__main__":
    main()
