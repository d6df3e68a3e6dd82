"""The etcd member's command line and where its data goes (pure parts of etcd_member.py and launch.py), and a
real member's data removed at its stop."""

from __future__ import annotations

import shutil
from pathlib import Path

from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.ha.etcd_member import EtcdMember, MemberSpec, member_command, remove_empty_parents
from exaserve_hpc.ha.etcd_tls import TlsFiles
from exaserve_hpc.app.ha_rank import member_data_dir, member_data_root
from tests.ha.conftest import free_ports, need_etcd


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


def test_removing_data_leaves_no_empty_parents_below_the_per_user_root(tmp_path):
    root = tmp_path / "exaserve-etcd-0"
    first, second = root / "77-2" / "etcd-0", root / "77-2" / "etcd-1"
    first.mkdir(parents=True), second.mkdir(parents=True)
    shutil.rmtree(first)
    remove_empty_parents(first, root)
    assert (root / "77-2").is_dir(), "another member of the run still uses it"
    shutil.rmtree(second)
    remove_empty_parents(second, root)
    assert not (root / "77-2").exists() and root.is_dir(), "the run's directory goes, the per-user root stays"
    outside = tmp_path / "elsewhere" / "d"
    outside.mkdir(parents=True)
    outside.rmdir()
    remove_empty_parents(outside, root)
    assert (tmp_path / "elsewhere").is_dir(), "nothing outside the root is touched"


def test_a_stopped_member_removes_its_run_directory(tmp_path, monkeypatch):
    need_etcd()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    rank = RankInfo(rank=0, size=1, node="n1", job_id="77", restart=2, source="local")
    data = member_data_dir(None, rank, "etcd-0")
    client, peer = free_ports(2)
    spec = MemberSpec("etcd-0", "127.0.0.1", client, peer, str(data))
    member = EtcdMember(spec, [spec], "exaserve-test", log_path=tmp_path / "etcd-0.log", remove_data=True,
                        data_root=member_data_root(None)).start()
    try:
        member.wait_ready(30)
        assert data.is_dir()
    finally:
        member.stop()
    assert not data.parent.exists(), f"{data.parent} left behind"
    assert member_data_root(None).is_dir()
