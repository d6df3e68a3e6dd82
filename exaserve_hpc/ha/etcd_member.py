"""One etcd member inside the allocation: Debian's `etcd` (3.4) as a child process of a rank.

    spec = MemberSpec("etcd-0", "10.77.0.1", 2379, 2380, job_dir / "etcd" / "restart-0" / "etcd-0")
    member = EtcdMember(spec, cluster=[spec, ...], token="exaserve-JOB-0").start()
    member.stop()

Every member must know every peer URL before it starts (etcd's static bootstrap), so the ranks that
run one publish their spec in the job directory first (launch.py). A data directory is per job run
(restart): a requeued job may land on other nodes, so its members form a new cluster; what must
survive a requeue is the HDF5 checkpoint's business. Listening and advertising use the node's
routable address (addresses.py), never a wildcard.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from exaserve_hpc.addresses import host_literal
from exaserve_hpc.config.schema import ETCD_BINARY
from exaserve_hpc.ha.etcd_client import EtcdClient
from exaserve_hpc.ha.etcd_tls import TlsFiles

log = logging.getLogger("exaserve.etcd")



class EtcdMemberError(Exception):
    pass


@dataclass(frozen=True)
class MemberSpec:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: str
    tls: bool = False  # https for clients and peers, certificates required both ways (etcd_tls.py)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{host_literal(self.host)}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{host_literal(self.host)}:{self.peer_port}"

    def to_json(self) -> dict:
        return asdict(self)


def member_command(spec: MemberSpec, cluster: list[MemberSpec], token: str, binary: str = ETCD_BINARY,
                   tls: Optional[TlsFiles] = None) -> list[str]:
    """The etcd command line for `spec` in a new cluster of `cluster` (pure). tls: this member's certificate."""
    secure = [] if tls is None else [
        "--cert-file", tls.cert, "--key-file", tls.key, "--client-cert-auth", "--trusted-ca-file", tls.ca,
        "--peer-cert-file", tls.cert, "--peer-key-file", tls.key, "--peer-client-cert-auth",
        "--peer-trusted-ca-file", tls.ca]
    return [binary, "--name", spec.name, "--data-dir", spec.data_dir,
            "--listen-client-urls", spec.client_url, "--advertise-client-urls", spec.client_url,
            "--listen-peer-urls", spec.peer_url, "--initial-advertise-peer-urls", spec.peer_url,
            "--initial-cluster", ",".join(f"{m.name}={m.peer_url}" for m in cluster),
            "--initial-cluster-state", "new", "--initial-cluster-token", token,
            # the store only holds the election key and the fleet state: old revisions go
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000",
            "--logger", "zap", "--log-level", "warn", "--enable-v2=false", *secure]


def remove_empty_parents(path: Path, root: Path) -> None:
    """rmdir each parent of `path` below `root` (not root itself) while it is empty; one in use stays."""
    root = Path(root)
    for parent in Path(path).parents:
        if parent == root or root not in parent.parents:
            return
        try:
            parent.rmdir()
        except OSError:  # not empty (another member of this run on this node), or gone already
            return


class EtcdMember:
    def __init__(self, spec: MemberSpec, cluster: list[MemberSpec], token: str, binary: str = ETCD_BINARY,
                 tls: Optional[TlsFiles] = None, client_tls: Optional[TlsFiles] = None,
                 log_path: Optional[Path] = None, remove_data: bool = False, data_root: Optional[Path] = None):
        """tls: this member's certificate (spec.tls); client_tls: what wait_ready presents; log_path: etcd's
        output (default beside the data directory); remove_data: the data directory goes at stop(), and so do
        its parents left empty below data_root (the per-user root, which stays: other jobs' members use it)."""
        self.spec, self.cluster, self.token = spec, list(cluster), token
        self.tls, self.client_tls = tls, client_tls
        self.binary = binary
        self.process: Optional[subprocess.Popen] = None
        self.log_path = Path(log_path) if log_path else Path(spec.data_dir).with_suffix(".log")
        self.remove_data = remove_data
        self.data_root = Path(data_root) if data_root else None

    def start(self) -> "EtcdMember":
        binary = shutil.which(self.binary)
        if binary is None:
            raise EtcdMemberError(f"no `{self.binary}` on PATH: install Debian's etcd-server (3.4) on the nodes, or "
                                  "set ha.etcd.endpoints to a centre's etcd instead of ha.etcd.members")
        Path(self.spec.data_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        log_file = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(member_command(self.spec, self.cluster, self.token, binary, self.tls),
                                            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # a Ctrl-C to the rank is ours to relay
        finally:
            log_file.close()
        log.info("etcd member %s started (pid %d): client %s, peer %s", self.spec.name, self.process.pid,
                 self.spec.client_url, self.spec.peer_url)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the cluster answers through this member (a quorum has formed), or EtcdMemberError."""
        client = EtcdClient([self.spec.client_url], timeout=1.0, tls=self.client_tls or self.tls)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EtcdMemberError(f"etcd member {self.spec.name} exited with {self.process.returncode}; see "
                                      f"{self.log_path}")
            if client.healthy():
                return
            time.sleep(0.2)
        raise EtcdMemberError(f"etcd member {self.spec.name} at {self.spec.client_url} formed no quorum within "
                              f"{timeout:.0f}s (peers: {', '.join(m.peer_url for m in self.cluster)}); see "
                              f"{self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            log.info("etcd member %s stopped", self.spec.name)
        if self.remove_data:
            shutil.rmtree(self.spec.data_dir, ignore_errors=True)
            if self.data_root is not None:
                remove_empty_parents(Path(self.spec.data_dir), self.data_root)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

