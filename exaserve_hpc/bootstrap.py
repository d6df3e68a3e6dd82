"""Bootstrap of one Slurm job: who am I (role by rank), who else is there (inventories), where is
the controller and how do we trust it (address + CURVE keys in the job directory).

    rank = detect_rank()                  # MPI rank under mpirun (mpi4py), else the batch system's (jobenv/)
    role = role_for(rank.rank)            # Role.CONTROLLER for rank 0, Role.AGENT otherwise
    jobdir = JobDir(path)                 # files mode 0600, written atomically

Exchange (`exchange_inventories` / `publish_controller` / `wait_for_controller`):
  - under MPI: one comm.gather of inventories to rank 0 and one comm.bcast of the controller's
    address and public key, then nothing collective ever again;
  - otherwise: every rank writes inventory/rank-R.json, rank 0 waits (bounded) for them, then
    writes controller.json; agents poll for a controller.json of *this* run (job id + restart
    count), so a file left by the run before a requeue is never taken for the current one.
After bootstrap a lost rank hangs or aborts nobody: liveness is the controller's heartbeats.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

log = logging.getLogger("exaserve.bootstrap")

MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


class BootstrapError(Exception):
    """Bootstrap cannot complete; the message says which rank waited for what, and where."""


class Role(enum.Enum):
    CONTROLLER = "controller"  # rank 0: controller thread, router, gateway; also the agent of its own node
    AGENT = "agent"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    size: int
    node: str          # Slurm node name (SLURMD_NODENAME), else the hostname
    job_id: str        # SLURM_JOB_ID, "local" outside Slurm
    restart: int       # SLURM_RESTART_COUNT: 0 first run, +1 per requeue
    source: str        # "mpi", "slurm" or "local"


def role_for(rank: int) -> Role:
    return Role.CONTROLLER if rank == 0 else Role.AGENT


def under_mpi(env: Mapping[str, str]) -> bool:
    """Launched by mpirun/mpiexec? Only then do we import mpi4py (its import initialises MPI)."""
    return any(v in env for v in MPI_RANK_VARIABLES)


def _mpi_comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def detect_rank(env: Optional[Mapping[str, str]] = None, comm: Any = None) -> RankInfo:
    """MPI rank under MPI; the batch system's (jobenv/: SLURM_PROCID/SLURM_NTASKS) in a job; 0 of 1 otherwise."""
    from exaserve_hpc.jobenv import detect_job_environment
    return detect_job_environment(env).rank_info(comm)


@dataclass
class NodeInventory:
    rank: int
    node: str
    hostname: str
    pid: int
    gpus: int = 0
    gpu_names: list[str] = field(default_factory=list)
    host_memory_total: int = 0

    @classmethod
    def probe(cls, rank: RankInfo) -> "NodeInventory":
        from exaserve_hpc.agent.nvml_probe import host_memory, read_gpus
        gpus, _ = read_gpus()
        return cls(rank=rank.rank, node=rank.node, hostname=socket.gethostname(), pid=os.getpid(), gpus=len(gpus),
                   gpu_names=[g.name for g in gpus], host_memory_total=host_memory()[0])


@dataclass
class ControllerInfo:
    """What rank 0 publishes: where to connect and which key proves it is our controller."""
    job_id: str
    restart: int
    endpoint: str                    # controller ROUTER, e.g. tcp://n1:40123
    gateway_url: str = ""
    server_public_key: str = ""      # Z85 CURVE key; "" when CURVE is off
    nodes: list[str] = field(default_factory=list)  # every rank's node, by rank
    published_at: float = 0.0
    error: str = ""  # rank 0 could not start the controller (the reason): every rank stops instead of waiting


# ---------------------------------------------------------------- job directory


class JobDir:
    """The job's directory on shared storage; every file we write in it is mode 0600."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def ensure(self) -> "JobDir":
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        for sub in ("inventory", "keys"):
            (self.path / sub).mkdir(exist_ok=True)
            os.chmod(self.path / sub, 0o700)
        return self

    def write_private(self, relative: str, data: bytes | str) -> Path:
        """Atomically (temp file + rename, same directory) and created 0600 from the start."""
        target = self.path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        return target

    def write_json(self, relative: str, obj: Any) -> Path:
        return self.write_private(relative, json.dumps(obj, indent=1, sort_keys=True))

    def read_json(self, relative: str) -> Optional[dict]:
        try:
            return json.loads((self.path / relative).read_text())
        except (OSError, ValueError):
            return None

    @property
    def controller_file(self) -> Path:
        return self.path / "controller.json"

    @property
    def stop_file(self) -> Path:
        """Created by the batch script when Slurm's --signal arrives (time limit near)."""
        return self.path / "stop-requested"


# ---------------------------------------------------------------- CURVE keys


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
    import zmq
    return bool(zmq.has("curve"))


def make_curve_keys(jobdir: JobDir) -> CurveKeys:
    import zmq
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = CurveKeys(server_public, server_secret, client_public, client_secret)
    for name, value in (("server.key", server_secret), ("client.key", client_secret),
                        ("server.pub", server_public), ("client.pub", client_public)):
        jobdir.write_private(f"keys/{name}", value)
    jobdir.write_private(f"keys/{KV_SALT_FILE}", os.urandom(32))  # the run's block-hash salt, new with its keys
    return keys


KV_SALT_FILE = "kv-salt"


def run_salt(jobdir: JobDir) -> bytes:
    """The run's secret block-hash salt (keys/kv-salt, 0600, made with the run's keys); b"" where the run
    has none (no CURVE keys): block hashes are then unsalted."""
    try:
        fd = os.open(jobdir.path / "keys" / KV_SALT_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise BootstrapError(f"the run's block-hash salt in {jobdir.path / 'keys'} cannot be read "
                             f"({exc.strerror}); the job directory must be shared by every node") from exc
    with os.fdopen(fd, "rb") as f:
        return f.read(64)


def install_block_hash_salt(jobdir: JobDir) -> bytes:
    """Key this process's block hashes (engines, the router's and gateway's prompt hashers) with the run's
    salt. Call it before any engine, router or gateway is made: replicas, router and gateway of one run must
    hash alike for precise prefix routing, and differently from every other run. Returns the salt."""
    from exaserve_hpc.engine.block_manager import set_block_hash_salt
    salt = run_salt(jobdir)
    set_block_hash_salt(salt)
    return salt


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


def replica_kv_event_keys(env: Mapping[str, str]) -> Optional[CurveKeys]:
    """A replica's KV-event publisher keys: a key pair of its own (its public key goes out in its hello,
    over the router's CURVE backend) admitting only the run's client key, which the router holds; with the
    run's block-hash salt installed in this process. None (and unsalted hashes) without the run's keys."""
    path = env.get(CURVE_JOB_DIR_VARIABLE)
    if not path:
        return None
    import zmq
    jobdir = JobDir(Path(path))
    client = load_client_keys(jobdir)
    install_block_hash_salt(jobdir)
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret, client.client_public, b"")


def secure_server(sock, keys: CurveKeys, context, name: str = "controller") -> "ZapLease":
    """Make a socket, before it binds, a CURVE server that admits only the job's client key.

    Returns a lease on the context's ZAP authenticator: stop() it once the socket is closed. `name`
    (the socket's role) appears in the line logged when a client is refused.
    """
    import zmq
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
        from zmq.auth.thread import ThreadAuthenticator
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


# ---------------------------------------------------------------- exchange


def exchange_inventories(rank: RankInfo, jobdir: JobDir, inventory: NodeInventory, comm: Any = None,
                         timeout: float = 60.0, poll: float = 0.2) -> list[NodeInventory]:
    """Every rank hands in its inventory; rank 0 gets them all (others get []).

    Under MPI: one gather. Otherwise through files; rank 0 waits at most `timeout` and proceeds with
    the ranks that reported (a node that died during start-up must not stop the others).
    """
    if comm is not None:
        gathered = comm.gather(asdict(inventory), root=0)
        return [NodeInventory(**g) for g in gathered] if rank.rank == 0 else []
    tag = f"{rank.job_id}.{rank.restart}"
    jobdir.write_json(f"inventory/rank-{rank.rank}.json", {"run": tag, **asdict(inventory)})
    if rank.rank != 0:
        return []
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for r in range(rank.size):
            data = jobdir.read_json(f"inventory/rank-{r}.json")
            if data and data.pop("run", None) == tag:
                found[r] = NodeInventory(**data)
        if len(found) == rank.size or time.monotonic() > deadline:
            break
        time.sleep(poll)
    missing = sorted(set(range(rank.size)) - set(found))
    if missing:
        log.warning("bootstrap: no inventory from rank(s) %s after %.0fs; continuing without them", missing, timeout)
    return [found[r] for r in sorted(found)]


def publish_controller(rank: RankInfo, jobdir: JobDir, info: ControllerInfo, comm: Any = None) -> None:
    """Rank 0: controller.json (0600) for file readers, plus one bcast under MPI."""
    info.published_at = time.time()
    jobdir.write_json("controller.json", asdict(info))
    if comm is not None:
        comm.bcast(asdict(info), root=0)


def _started(rank: RankInfo, info: ControllerInfo) -> ControllerInfo:
    if info.error:
        raise BootstrapError(f"rank {rank.rank} on {rank.node}: rank 0 could not start the controller, so this "
                             f"rank stops too: {info.error}")
    return info


def wait_for_controller(rank: RankInfo, jobdir: JobDir, comm: Any = None, timeout: float = 300.0,
                        poll: float = 0.2) -> ControllerInfo:
    """Agents: the controller of *this* run (same job id and restart count)."""
    if comm is not None:
        return _started(rank, ControllerInfo(**comm.bcast(None, root=0)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = jobdir.read_json("controller.json")
        if data and data.get("job_id") == rank.job_id and data.get("restart") == rank.restart:
            return _started(rank, ControllerInfo(**data))
        time.sleep(poll)
    raise BootstrapError(f"rank {rank.rank} on {rank.node}: no controller.json for job {rank.job_id} restart "
                         f"{rank.restart} in {jobdir.path} after {timeout:.0f}s; is rank 0 running? "
                         f"(see the job's output file)")
