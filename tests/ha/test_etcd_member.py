"""The etcd member's command line and where its data goes (pure parts of etcd_member.py and launch.py)."""

from __future__ import annotations

from pathlib import Path

from exaserve_hpc.bootstrap import RankInfo
from exaserve_hpc.ha.etcd_member import MemberSpec, member_command
from exaserve_hpc.ha.etcd_tls import TlsFiles
from exaserve_hpc.ha.launch import member_data_dir


def test_command_names_every_peer_and_requires_certificates():
    specs = [MemberSpec(f"etcd-{i}", f"10.77.0.{i + 1}", 2379, 2380, f"/tmp/d{i}", tls=True) for i in range(3)]
    tls = TlsFiles("/j/ca.crt", "/j/etcd-0.crt", "/j/etcd-0.key")
    command = member_command(specs[0], specs, "tok", binary="etcd", tls=tls)
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags["--listen-client-urls"] == flags["--advertise-client-urls"] == "https://10.77.0.1:2379"
    assert flags["--initial-cluster"] == ("etcd-0=https://10.77.0.1:2380,etcd-1=https://10.77.0.2:2380,"
                                          "etcd-2=https://10.77.0.3:2380")
    assert {"--client-cert-auth", "--peer-client-cert-auth"} <= set(command)
    assert command[command.index("--trusted-ca-file") + 1] == "/j/ca.crt"
    plain = member_command(MemberSpec("e", "::1", 1, 2, "/d"), [MemberSpec("e", "::1", 1, 2, "/d")], "t")
    assert "http://[::1]:1" in plain and "--client-cert-auth" not in plain


def test_data_is_node_local_by_default(monkeypatch):
    rank = RankInfo(rank=1, size=4, node="n2", job_id="77", restart=2, source="slurm")
    monkeypatch.setenv("TMPDIR", "/scratch/local")
    assert member_data_dir(None, rank, "etcd-1").parts[:3] == ("/", "scratch", "local")
    assert member_data_dir(None, rank, "etcd-1").parts[-2:] == ("77-2", "etcd-1")
    assert member_data_dir("/nvme/etcd", rank, "etcd-1") == Path("/nvme/etcd/77-2/etcd-1")
