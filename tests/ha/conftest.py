"""A real 3-member etcd (Debian's etcd-server) on loopback ports, for the HA tests.

Under CI=true a missing `etcd` fails these tests (the suite's rule for real components) instead of
skipping them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable
from exaserve_hpc.ha.fleet_store import read_state
from exaserve_hpc.app.ha_rank import etcd_prefix
from exaserve_hpc.ha.etcd_member import EtcdMember, MemberSpec
from exaserve_hpc.ha.etcd_tls import ensure_ca, issue


def free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def need_etcd() -> None:
    if shutil.which("etcd"):
        return
    why = "no `etcd` on PATH (Debian package etcd-server; tests/run.sh installs it)"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"CI=true: the HA tests need a real etcd: {why}")
    pytest.skip(why)


def start_cluster(base, host: str = "127.0.0.1", size: int = 3, token: str = "exaserve-test") -> list[EtcdMember]:
    """A new cluster with TLS both ways, as `exaserve launch` starts one (certificates under base/pki)."""
    ports = free_ports(2 * size)
    pki = base / "pki"
    ca = ensure_ca(pki)
    client = issue(pki, "client", ca)
    specs = [MemberSpec(f"etcd-{i}", host, ports[2 * i], ports[2 * i + 1], str(base / f"etcd-{i}"), tls=True)
             for i in range(size)]
    members = [EtcdMember(spec, specs, token, tls=issue(pki, spec.name, ca, ips=[host]), client_tls=client).start()
               for spec in specs]
    try:
        for member in members:
            member.wait_ready(30)
    except Exception:
        for member in members:
            member.stop()
        raise
    return members


@pytest.fixture
def etcd_cluster(tmp_path):
    """Three members on 127.0.0.1; yields the EtcdMember list (client URLs: m.spec.client_url)."""
    need_etcd()
    members = start_cluster(tmp_path / "etcd")
    yield members
    for member in members:
        member.stop()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns(tmp_path):
    """A network namespace joined to this one by a veth pair: 10.78.N.1 here, 10.78.N.2 inside."""
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail("CI=true: the partition tests need root (network namespaces)")
        pytest.skip("network namespaces need root")
    n = os.getpid() % 200 + 20
    name, host_if, ns_if = f"exha{n}", f"exhah{n}", f"exhan{n}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    ip("netns", "add", name)
    ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
    ip("link", "set", ns_if, "netns", name)
    ip("addr", "add", f"10.78.{n}.1/24", "dev", host_if)
    ip("link", "set", host_if, "up")
    ip("netns", "exec", name, "ip", "addr", "add", f"10.78.{n}.2/24", "dev", ns_if)
    ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
    ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
    ip("netns", "exec", name, "ip", "route", "add", "default", "via", f"10.78.{n}.1")  # this side's other addresses
    yield name, host_if, f"10.78.{n}.1"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def client_for(members, **options) -> EtcdClient:
    """A client of the fixture's cluster with the job's client certificate."""
    return EtcdClient([m.spec.client_url for m in members], tls=members[0].client_tls, **options)


def fleet_state_names(client: EtcdClient, job_id: str, replica_ids) -> bool:
    """Whether the leader's writer has put a fleet state naming every one of `replica_ids` in etcd (what a
    standby restores from): the tests wait on this before killing the leader, instead of a fixed sleep."""
    try:
        state = read_state(client, etcd_prefix(job_id))
    except EtcdUnavailable:
        return False
    return state is not None and set(replica_ids) <= set(state.placement)


def tls_args(members) -> list[str]:
    """candidate.py's --tls CA,CERT,KEY for the fixture's cluster."""
    t = members[0].client_tls
    return ["--tls", f"{t.ca},{t.cert},{t.key}"]


def tls_settings(members) -> dict:
    """ha.etcd's ca_file, cert_file, key_file for the fixture's cluster (a centre's etcd, to the job)."""
    t = members[0].client_tls
    return {"ca_file": t.ca, "cert_file": t.cert, "key_file": t.key}


def logged_at(text: str, fragment: str) -> float:
    """The time of the first log line holding `fragment` (logging's `YYYY-MM-DD HH:MM:SS,mmm` prefix)."""
    for line in text.splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if match and fragment in line:
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(match.group(2)) / 1000
    return 0.0


NODES = ["nodea", "nodeb", "nodec"]  # the three local ranks' node names in the launch tests


def start_rank(site_file: Path, job_dir: Path, rank: int, log: Path, job_id: str, curve: bool = False,
               netns: str = "") -> subprocess.Popen:
    """One `exaserve launch` rank on this machine, srun's variables set by hand (in network namespace
    `netns` when given), in its own process group so a test can kill the rank with all it started."""
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(len(NODES)),
           "SLURMD_NODENAME": NODES[rank]}
    command = [sys.executable, "-m", "exaserve_hpc.launcher", "--site", str(site_file), "--job-dir", str(job_dir),
               "--port", "0", *([] if curve else ["--no-curve"])]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_ranks(ranks) -> None:
    """Every rank's whole process group (its agent, replicas, etcd member) killed and reaped; a rank
    already gone is fine. The tests' finally."""
    for p in ranks:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def read_json(path: Path) -> dict:
    """A JSON file the ranks write, or {} while it is missing or half written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cli_status(job_dir: Path) -> dict:
    """`exaserve status --json --run-dir JOB_DIR`, or {} when it fails (no leader published yet)."""
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                             str(job_dir)], capture_output=True, text=True, timeout=30)
    return json.loads(result.stdout) if result.returncode == 0 else {}
