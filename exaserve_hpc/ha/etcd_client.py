"""The one seam to etcd: etcd3gw (the maintained client of etcd's v3 HTTP/JSON gateway) over several members.

    etcd = EtcdClient(["http://10.77.0.1:2379", "http://10.77.0.2:2379"], timeout=2.0)
    lease = etcd.grant(10)                      # lease id
    etcd.keepalive(lease)                       # the TTL granted again; <= 0: the lease is gone
    won, holder = etcd.create_if_absent(key, value, lease)    # the campaign: one txn
    etcd.put_if_created_at(guard_key, revision, {key: value}) # a fenced write: False when the guard moved
    etcd.get(key)                               # KeyValue or None

etcd3gw talks to one member; this class keeps one client per endpoint and moves to the next member
when one does not answer (a lost node's member), so callers see one etcd. Each member is given
`timeout` seconds; the member that answered is asked first from then on, so a lost member costs one
timeout once. (A leader's gate does not wait for a call: election.acting() reads the clock.)
Why etcd3gw and not a gRPC client: it needs only `requests`, and etcd 3.4's gateway serves /v3/.
etcd's JSON carries int64 as strings, bytes as base64, and omits false and zero fields.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw import exceptions as etcd_exceptions

from exaserve_hpc import metrics
from exaserve_hpc.ha.etcd_tls import TlsFiles

log = logging.getLogger("exaserve.etcd")


class EtcdUnavailable(Exception):
    """No endpoint answered within the timeout, or none could serve the call (names each endpoint's error)."""


class EtcdRefused(EtcdUnavailable):
    """A member answered and refused the request itself (e.g. "etcdserver: request is too large"): no other
    member would take it either. A kind of EtcdUnavailable, so every caller's "the call did not take effect"
    handling covers it; the message says what etcd answered instead of blaming the network."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(raw: dict) -> KeyValue:
    return KeyValue(key=base64.b64decode(raw["key"]).decode(), value=base64.b64decode(raw.get("value", "")),
                    create_revision=int(raw.get("create_revision", 0)), mod_revision=int(raw.get("mod_revision", 0)),
                    lease=int(raw.get("lease", 0)))


def _range_end(prefix: str) -> str:
    data = bytearray(prefix.encode())
    data[-1] += 1
    return _b64(bytes(data))


def _session(tls: Optional[TlsFiles]) -> requests.Session:
    """Our own session, blind to the environment: REQUESTS_CA_BUNDLE (common on clusters) would replace the
    job's CA in requests' verification, and an HTTP(S)_PROXY would send allocation-internal calls outside."""
    session = requests.Session()
    session.trust_env = False
    if tls is not None:
        session.verify = tls.ca
        session.cert = (tls.cert, tls.key)
    return session


# gRPC codes (in the JSON gateway's error body) that judge the request, not the member's state:
# InvalidArgument ("request is too large", "too many operations in txn"), NotFound, AlreadyExists,
# PermissionDenied, FailedPrecondition, OutOfRange, Unauthenticated
REFUSAL_CODES = frozenset({3, 5, 6, 7, 9, 11, 16})


def refused(detail: Optional[str]) -> bool:
    """Whether an error answer refuses the request itself (pure); unknown bodies are not (the next member is tried)."""
    try:
        body = json.loads(detail or "")
        code, error = body.get("code"), str(body.get("error", ""))
    except (ValueError, AttributeError):
        return False
    # ResourceExhausted (8) is also "too many requests" (transient); a message over gRPC's limit is not
    return code in REFUSAL_CODES or (code == 8 and "larger than max" in error)


class EtcdClient:
    def __init__(self, endpoints: list[str], timeout: float = 2.0, tls: Optional[TlsFiles] = None):
        """tls: the CA to trust and the client certificate to present (https endpoints; etcd_tls.py)."""
        if not endpoints:
            raise ValueError("no etcd endpoint given (ha.etcd.endpoints, or members started by exaserve launch)")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._clients = []
        for url in self.endpoints:
            parts = urlsplit(url)
            self._clients.append(Etcd3Client(host=parts.hostname, port=parts.port or 2379, protocol=parts.scheme,
                                             timeout=timeout, api_path="/v3/", session=_session(tls)))
        self._current = 0
        self._lock = threading.Lock()
        for kind in ("unavailable", "refused"):  # both series from the start, at 0, for rate() in alerts
            metrics.HA_ETCD_ERRORS.labels(kind)

    def _post(self, path: str, body: dict) -> dict:
        """POST to the current member; on a connection failure, a timeout or a server error, to the next ones in
        turn. A request a member refused (`refused`: invalid, too large, not permitted) is EtcdRefused at once."""
        errors, answered = [], False
        with self._lock:
            start = self._current
        for i in range(len(self._clients)):
            index = (start + i) % len(self._clients)
            client = self._clients[index]
            try:
                result = client.post(client.get_url(path), json=body)
            except (etcd_exceptions.ConnectionFailedError, etcd_exceptions.ConnectionTimeoutError) as exc:
                errors.append(f"{self.endpoints[index]}: {type(exc).__name__}")
                continue
            except etcd_exceptions.Etcd3Exception as exc:
                if refused(exc.detail_text):  # about the request itself: no other member would take it
                    metrics.HA_ETCD_ERRORS.labels("refused").inc()
                    raise EtcdRefused(f"etcd member {self.endpoints[index]} refused {path}: {exc.detail_text}") from exc
                # a member cut off from its quorum answers "etcdserver: request timed out" (HTTP 500/503):
                # another member may be in the majority
                errors.append(f"{self.endpoints[index]}: {exc.detail_text or type(exc).__name__}")
                answered = True
                continue
            if index != start:
                with self._lock:
                    self._current = index
            return result
        metrics.HA_ETCD_ERRORS.labels("unavailable").inc()
        if answered:  # some answered, with an error: not a network problem alone
            raise EtcdUnavailable(f"no etcd member could serve {path} (each given {self.timeout:g}s): "
                                  f"{'; '.join(errors)}")
        raise EtcdUnavailable(f"no etcd member answered within {self.timeout:g}s: {'; '.join(errors)}")

    # ---------------------------------------------------------------- leases

    def grant(self, ttl: float) -> tuple[int, int]:
        """A new lease: (id, the TTL granted in whole seconds)."""
        result = self._post("/lease/grant", {"TTL": max(1, round(ttl)), "ID": 0})
        return int(result["ID"]), int(result.get("TTL", 0))

    def keepalive(self, lease: int) -> int:
        """Renew: the TTL the lease was reset to; <= 0 when it had already expired."""
        result = self._post("/lease/keepalive", {"ID": lease})
        return int(result.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    # ---------------------------------------------------------------- keys

    def get(self, key: str) -> Optional[KeyValue]:
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [_kv(kv) for kv in self._post("/kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix)})
                .get("kvs", [])]

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Unconditional (tests, and keys nobody fences); the store's revision after it."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        return int(self._post("/kv/put", body)["header"]["revision"])

    def create_if_absent(self, key: str, value: bytes | str, lease: int) -> tuple[bool, Optional[KeyValue]]:
        """One txn: put `key` bound to `lease` if no one holds it. (True, our KeyValue) or (False, the holder's)."""
        result = self._post("/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
            "failure": [{"request_range": {"key": _b64(key)}}]})
        if result.get("succeeded"):
            revision = int(result["header"]["revision"])
            data = value.encode() if isinstance(value, str) else value
            return True, KeyValue(key, data, revision, revision, lease)
        kvs = result.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, (_kv(kvs[0]) if kvs else None)

    def put_if_created_at(self, guard: str, create_revision: int, values: dict[str, bytes | str]) -> bool:
        """Fencing: write `values` only while `guard` is the key created at `create_revision` (the writer's own
        election key). False when it is gone or another candidate's: the writer is no longer the leader."""
        result = self._post("/kv/txn", {
            "compare": [{"key": _b64(guard), "target": "CREATE", "result": "EQUAL",
                         "create_revision": str(create_revision)}],
            "success": [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in values.items()]})
        return bool(result.get("succeeded"))

    def delete_if_created_at(self, key: str, create_revision: int) -> bool:
        """Resign: delete our own election key, and only ours."""
        result = self._post("/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": str(create_revision)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}]})
        return bool(result.get("succeeded"))

    def healthy(self) -> bool:
        """The cluster answers a linearizable read (a quorum is up)."""
        try:
            self._post("/kv/range", {"key": _b64("/exaserve-health")})
        except EtcdUnavailable:
            return False
        return True
