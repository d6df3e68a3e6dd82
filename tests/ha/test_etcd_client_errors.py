"""EtcdClient tells a refused request from an unreachable etcd: a real member's "request is too large" is
EtcdRefused naming etcd's answer (not "no member answered"); closed ports are "no member answered"."""

from __future__ import annotations

import json

import pytest

from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdRefused, EtcdUnavailable, refused
from tests.ha.conftest import client_for, free_ports


def test_which_error_answers_refuse_the_request():
    assert refused(json.dumps({"error": "etcdserver: request is too large", "code": 3}))
    assert refused(json.dumps({"error": "grpc: received message larger than max (2097172 vs. 2097152)", "code": 8}))
    assert not refused(json.dumps({"error": "etcdserver: too many requests", "code": 8}))
    assert not refused(json.dumps({"error": "etcdserver: request timed out", "code": 14}))
    assert not refused("<html>bad gateway</html>") and not refused(None) and not refused("[1]")


def test_a_request_too_large_is_refused_not_unavailable(etcd_cluster):
    etcd = client_for(etcd_cluster)
    with pytest.raises(EtcdRefused, match="request is too large") as caught:
        etcd.put("/t/errors/big", b"x" * (1600 * 1024))  # over etcd's default 1.5 MiB request limit
    assert "no etcd member answered" not in str(caught.value)
    assert isinstance(caught.value, EtcdUnavailable)  # callers' "did not take effect" handling covers it
    with pytest.raises(EtcdRefused, match="larger than max"):
        etcd.put("/t/errors/bigger", b"x" * (2 * 1024 * 1024))  # over the gateway's 2 MiB gRPC message limit
    etcd.put("/t/errors/small", "ok")  # the cluster itself is fine
    assert etcd.get("/t/errors/small").value == b"ok"


def test_no_member_listening_is_no_answer():
    etcd = EtcdClient([f"http://127.0.0.1:{p}" for p in free_ports(2)], timeout=1.0)
    with pytest.raises(EtcdUnavailable, match="no etcd member answered within 1s") as caught:
        etcd.get("/t/errors/none")
    assert not isinstance(caught.value, EtcdRefused)
