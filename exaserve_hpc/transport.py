"""The run's CURVE layer: key files in the job directory, and the ZeroMQ sockets that use them.

    keys = make_curve_keys(jobdir)              # rank 0 / `exaserve serve`: server + client key pairs, 0600
    lease = secure_server(sock, keys, context)  # before bind: admits only the run's client key (ZAP)
    secure_client(sock, load_client_keys(jobdir))

Every exaserve socket between processes of a run is a CURVE server or client through these functions; a
process that can reach a port but cannot read the job directory is refused.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator

from exaserve_hpc.jobdir import KV_SALT_FILE, BootstrapError, JobDir

log = logging.getLogger("exaserve.transport")


@dataclass(frozen=True)
class CurveKeys:
    """Per-job keys: the controller's keypair, and one client keypair every agent of the job uses.

    The controller accepts only that client key (ZAP), so reaching the port is not enough: a
    peer must be able to read the job directory (mode 0700, files 0600).
    """
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_available() -> bool:
    return bool(zmq.has("curve"))


def make_curve_keys(jobdir: JobDir) -> CurveKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = CurveKeys(server_public, server_secret, client_public, client_secret)
    for name, value in (("server.key", server_secret), ("client.key", client_secret),
                        ("server.pub", server_public), ("client.pub", client_public)):
        jobdir.write_private(f"keys/{name}", value)
    jobdir.write_private(f"keys/{KV_SALT_FILE}", os.urandom(32))  # the run's block-hash salt, new with its keys
    return keys


def load_client_keys(jobdir: JobDir, server_public: str = "") -> CurveKeys:
    """The job's client keys, for the server key published in controller.json (default: keys/server.pub)."""
    keys = jobdir.path / "keys"
    try:
        return CurveKeys(server_public.encode() or (keys / "server.pub").read_bytes(), b"",
                         (keys / "client.pub").read_bytes(), (keys / "client.key").read_bytes())
    except OSError as exc:
        raise BootstrapError(f"the controller publishes a CURVE key but the client keys in {keys} cannot be read "
                             f"({exc.strerror}); the job directory must be shared by every node") from exc


CURVE_JOB_DIR_VARIABLE = "EXASERVE_CURVE_JOB_DIR"  # set by the node agent for its replica processes


def replica_client_keys(env: Mapping[str, str]) -> Optional[CurveKeys]:
    """A replica process's keys for the router backend, read from the job directory its agent names.

    The variable carries a path, never a key: the command line (the StartReplica spec) is readable
    by every user of the node, and the files in the job directory only by ours. None: no CURVE.
    """
    path = env.get(CURVE_JOB_DIR_VARIABLE)
    return load_client_keys(JobDir(Path(path))) if path else None




def secure_server(sock, keys: CurveKeys, context, name: str = "controller") -> "ZapLease":
    """Make a socket, before it binds, a CURVE server that admits only the job's client key.

    Returns a lease on the context's ZAP authenticator: stop() it once the socket is closed. `name`
    (the socket's role) appears in the line logged when a client is refused.
    """
    domain = f"{name}/{keys.server_public.decode()}"
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler running: refuse, not admit any key
    except (AttributeError, zmq.ZMQError):  # libzmq < 4.3: the authenticator (running before bind) still checks
        pass
    return ZapLease.take(context, domain, name, keys.client_public)


class ClientKeyCheck:
    """ZAP credentials for one domain: admits the job's client key; logs each refused key once."""
    MAX_LOGGED = 1000  # refused keys remembered, so a peer trying many keys cannot grow this without bound

    def __init__(self, name: str, client_public: bytes):
        self.name = name
        self.client_public = client_public
        self.refused: set[bytes] = set()
        self.leases = 0

    def callback(self, domain: str, client_key: bytes) -> bool:  # Z85 key, on the authenticator's thread
        if client_key == self.client_public:
            return True
        if client_key not in self.refused and len(self.refused) < self.MAX_LOGGED:
            self.refused.add(client_key)
            log.warning("%s: refused a CURVE client whose key %s is not this job's; it is not served "
                        "(logged once per key)", self.name, client_key.decode(errors="replace"))
        return False


class ZapLease:
    """A CURVE server socket's share of its context's one ZAP authenticator.

    libzmq asks for ZAP at one inproc endpoint per context, so a second ThreadAuthenticator in a
    context cannot start (EADDRINUSE): the controller and the router sockets, all in
    zmq.Context.instance() under `exaserve launch`, share one. Each socket's ZAP domain names its
    role and key set; the authenticator stops when the last lease does.
    """
    _lock = threading.Lock()
    _by_context: dict[Any, tuple[Any, dict[str, ClientKeyCheck]]] = {}  # context -> (authenticator, checks)

    def __init__(self, context, domain: str):
        self.context = context
        self.domain = domain
        self.stopped = False

    @classmethod
    def take(cls, context, domain: str, name: str, client_public: bytes) -> "ZapLease":
        with cls._lock:
            if context not in cls._by_context:
                auth = ThreadAuthenticator(context)
                auth.start()
                cls._by_context[context] = (auth, {})
            auth, checks = cls._by_context[context]
            if domain not in checks:
                checks[domain] = ClientKeyCheck(name, client_public)
                auth.configure_curve_callback(domain=domain, credentials_provider=checks[domain])
            checks[domain].leases += 1
            return cls(context, domain)

    def stop(self) -> None:
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            auth, checks = self._by_context[self.context]
            checks[self.domain].leases -= 1
            if checks[self.domain].leases == 0:
                del checks[self.domain]
                auth.credentials_providers.pop(self.domain, None)
            if not checks:
                del self._by_context[self.context]
                auth.stop()


def secure_client(sock, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
