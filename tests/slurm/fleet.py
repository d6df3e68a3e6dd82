"""Helpers for the end-to-end Slurm tests and benchmarks/bench_failover.py: submit the exaserve job on
the local test cluster, wait until it serves, drive a steady request stream, kill and revive nodes.

The cluster's nodes have private /tmp and /dev/shm (tests/slurm/cluster.sh), as real nodes do, so a
job's files (site file, job root) live in `shared_dir()`, the cluster's stand-in for a shared
filesystem; a node's /dev/shm is seen from here at `node_shm(node)`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import yaml

from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
SLURM_DIR = Path(os.environ.get("EXASERVE_SLURM_DIR", "/var/tmp/exaserve-slurm"))


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=180)
    if check and result.returncode != 0:
        logs = subprocess.run(["bash", str(CLUSTER), "logs"], capture_output=True, text=True).stdout
        raise RuntimeError(f"cluster.sh {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n"
                           f"{result.stderr}\n{logs}")
    return result


NODES = ("n1", "n2", "n3", "n4")


def shared_dir(prefix: str) -> Path:
    """A fresh directory every virtual node sees (their /tmp is their own): under the cluster's shared/."""
    root = SLURM_DIR / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))


def remove_shared_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def node_shm(node: str) -> Path:
    """Node `node`'s /dev/shm, seen from the root namespace (a tmpfs cluster.sh mounts per node)."""
    return SLURM_DIR / "nodes" / node / "shm"


def shm_files(node: str) -> list[str]:
    """Every file under the node's /dev/shm (L2 caches live there), relative paths."""
    base = node_shm(node)
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


def task_exits(job_id: int, step: int = 0) -> dict[int, str]:
    """Rank -> how its task ended ("exit 0", "signal 9"), from every node's slurmd log (the cluster
    logs at verbose level; there is no accounting database here for sacct)."""
    import re
    pattern = re.compile(rf"\[{job_id}\.{step}\] task (\d+) \(\d+\) exited(?: with exit code (\d+)|\. Killed by signal (\d+))")
    ended: dict[int, str] = {}
    for log in sorted((SLURM_DIR / "log").glob("slurmd-*.log")):
        for match in pattern.finditer(log.read_text(errors="replace")):
            rank, code, signal = match.groups()
            ended[int(rank)] = f"exit {code}" if code is not None else f"signal {signal}"
    return ended


def epilog_lines(job_id: int) -> list[str]:
    """What the shipped epilog (sbatch/exaserve-epilog.sh) said about this job on each node."""
    try:
        text = (SLURM_DIR / "log" / "epilog.log").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if f" job {job_id}: " in line]


def environ(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def check_devices(status: dict, fraction: dict[str, float]) -> dict[str, list[dict]]:
    """What status shows for each serving replica is what its process was given: CUDA_VISIBLE_DEVICES
    (read from /proc/PID/environ), within the GPUs Slurm granted its node's step (the agent's own
    environment); two replicas of a node share a device only when their models use a fraction of a GPU.
    Returns the serving replicas by node."""
    agents = {a["agent_id"]: a for a in status["agents"]}
    by_node: dict[str, list[dict]] = {}
    for replica in status["replicas"]:
        if replica["state"] != "serving":
            continue
        assert replica.get("devices"), f"status shows no devices for {replica['replica_id']}: {replica}"
        env = environ(replica["pid"])
        assert env.get("SLURMD_NODENAME") == replica["node"], (replica, env.get("SLURMD_NODENAME"))
        assert env.get("CUDA_VISIBLE_DEVICES", "").split(",") == replica["devices"], (replica, env)
        assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        # The step's grant on that node, as Slurm gave it to the node's task (the agent).
        step = environ(agents[replica["node"]]["pid"])
        granted = step["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(granted) == 4 and step["SLURM_STEP_GPUS"].split(",") == ["0", "1", "2", "3"], step
        assert set(replica["devices"]) <= set(granted), (replica, granted)
        by_node.setdefault(replica["node"], []).append(replica)
    for node, replicas in by_node.items():
        for i, a in enumerate(replicas):
            for b in replicas[i + 1:]:
                if set(a["devices"]) & set(b["devices"]):
                    assert fraction[a["model"]] < 1 and fraction[b["model"]] < 1, (node, a, b)
    return by_node


def node_processes(node: str) -> list[int]:
    """Every process of virtual node `node`: those in its network namespace (slurmd runs there and every
    step and task inherits it), and any whose environment names the node (SLURMD_NODENAME)."""
    try:
        netns = os.stat(f"/var/run/netns/exaserve-{node}").st_ino
    except OSError:
        netns = None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if netns is not None and os.stat(entry / "ns" / "net").st_ino == netns:
                found.append(int(entry.name))
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in env or f"EXASERVE_VNODE={node}".encode() in env:
            found.append(int(entry.name))
    return found


def echo_site(directory: Path, replicas: int = 4, heartbeat: str = "2s", misses: int = 3) -> Path:
    """slurm-local with echo replicas (the four virtual nodes share two cores) under `directory`.
    The gateway listens on every interface of rank 0's node and publishes that node's own address,
    which this (root) namespace reaches over the cluster's bridge."""
    data = yaml.safe_load((ROOT / "site-configs" / "slurm-local.yaml").read_text())
    model = data["models"][0]
    model.pop("tiny", None)
    model.update(engine="echo", replicas=replicas, min_replicas=replicas)  # no autoscaling mid-test
    data["weight_cache"]["l3_path"] = str(directory / "models")
    data["run_dir"] = str(directory / "run")
    data["heartbeat"] = {"interval": heartbeat, "misses": misses}
    data.setdefault("gateway", {})["host"] = "0.0.0.0"
    path = directory / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class Job:
    job_id: int
    job_root: Path

    @property
    def job_dir(self) -> Path:
        return self.job_root / str(self.job_id)

    @property
    def output(self) -> Path:
        return self.job_root / f"exaserve-{self.job_id}.out"

    def log(self) -> str:
        try:
            return self.output.read_text()
        except OSError:
            return "(no job output yet)"

    def url(self) -> Optional[str]:
        try:
            return json.loads((self.job_dir / "serve.json").read_text())["url"]
        except (OSError, ValueError, KeyError):
            return None

    def status(self) -> dict:
        return httpx.get(f"{self.url()}/v1/exaserve/status", timeout=10).json()

    def cancel(self) -> None:
        subprocess.run(["scancel", str(self.job_id)], capture_output=True)

    def cancel_and_wait(self, timeout: float = 30.0) -> None:
        """scancel, then wait (at most `timeout`) until Slurm reports the job ended or forgets it."""
        from exaserve_hpc.batch.slurm.client import CliSlurmClient
        self.cancel()
        client = CliSlurmClient()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if client.job(self.job_id).state.terminal:
                    return
            except Exception:
                return
            time.sleep(0.5)


def wait_job(predicate, timeout: float, what: str, job: Job, poll: float = 0.5):
    """predicate()'s first true value within `timeout`; on time-out an AssertionError carrying the job's
    output and the cluster's log tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    logs = cluster("logs", check=False).stdout[-4000:]
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\njob output:\n{job.log()}\n"
                         f"cluster logs (tail):\n{logs}")


def submit(site: Path, job_root: Path, nodes: int = 4, extra: tuple[str, ...] = (), launcher_args: str = "",
           port: Optional[int] = 0, log_dir: Optional[Path] = None) -> Job:
    """`exaserve submit` the site's job; `port`: the gateway's --port (None: the site's gateway.port);
    `log_dir`: every process of the job writes its own log file there (EXASERVE_LOG_DIR, which the job
    inherits from the submitting environment: useful where the job's output is on a node a test kills)."""
    port_flag = "" if port is None else f"--port {port} "
    launcher = f"{sys.executable} -m exaserve_hpc.launcher {port_flag}{launcher_args}".rstrip()
    env = None if log_dir is None else {**os.environ, "EXASERVE_LOG_DIR": str(log_dir)}
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "submit", "--site", str(site), "--nodes",
                             str(nodes), "--time", "15m", "--job-root", str(job_root), "--option",
                             f"launcher={launcher}", *extra], capture_output=True, text=True, timeout=60, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"exaserve submit failed ({result.returncode}): {result.stderr}")
    job_id = int(result.stdout.split("submitted job ")[1].split(":")[0])
    return Job(job_id, job_root)


def wait_serving(job: Job, agents: int, replicas: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        if job.url():
            try:
                status = job.status()
            except (httpx.HTTPError, ValueError):
                status = {}
            alive = [a for a in status.get("agents", []) if a["state"] == "alive"]
            serving = [r for r in status.get("replicas", []) if r["state"] == "serving"]
            if len(alive) >= agents and len(serving) >= replicas:
                return status
        time.sleep(0.3)
    raise AssertionError(f"job {job.job_id} not serving {replicas} replicas on {agents} agents in {timeout}s; "
                         f"status {json.dumps(status)[:2000]}\njob output:\n{job.log()}")


@dataclass
class Outcome:
    started: float
    finished: float
    ok: bool
    detail: str = ""
    worker: int = 0


@dataclass
class RequestStream:
    """`workers` threads, each sending one completion request every `interval` seconds, until stopped;
    worker i's n-th request asks for models[(i + n) % len(models)]."""
    url: str
    workers: int = 4
    interval: float = 0.05
    models: tuple[str, ...] = ("tiny-llama",)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _worker(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                started = time.time()
                try:
                    response = client.post(f"{self.url}/v1/completions",
                                            json={"model": self.models[(index + n) % len(self.models)],
                                                  "prompt": f"w{index} r{n}", "max_tokens": 8})
                    ok = response.status_code == 200 and response.json()["choices"][0]["text"] != ""
                    detail = "" if ok else f"{response.status_code} {response.text[:200]}"
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    ok, detail = False, repr(exc)
                self.outcomes.append(Outcome(started, time.time(), ok, detail, index))
                self._stop.wait(self.interval)

    def start(self) -> "RequestStream":
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    def flowing(self, answered: int = 20, timeout: float = 60.0) -> "RequestStream":
        """Wait until `answered` requests have been answered: the stream is under way (before a fault)."""
        wait_for(lambda: self.sent >= answered, timeout, f"{answered} answered requests")
        return self

    def settle(self, timeout: float = 90.0) -> None:
        """Wait until every request in flight now has finished: each worker has since sent another (its
        requests go one after the other), so none that saw a fault is still open when the stream stops."""
        since = time.time()
        wait_for(lambda: {o.worker for o in list(self.outcomes) if o.started >= since} >= set(range(self.workers)),
                 timeout, "every request in flight to finish")

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


@dataclass
class FailoverTimings:
    killed_at: float
    detected_at: float      # controller declared the node lost
    serving_at: float       # every replica serving again, none on the lost node
    sent: int
    completed: int

    def report(self) -> str:
        detected = f"{self.detected_at - self.killed_at:.2f}s" if self.detected_at else "never"
        serving = f"{self.serving_at - self.killed_at:.2f}s" if self.serving_at else "never"
        return (f"kill -> detected {detected}; kill -> serving again {serving}; "
                f"requests sent {self.sent}, completed {self.completed}")


def kill_and_watch(job: Job, node: str, replicas: int, stream: RequestStream,
                   timeout: float = 90.0) -> tuple[FailoverTimings, dict]:
    """Kill `node` while `stream` runs; return the timings and the final status."""
    killed_at = time.time()
    cluster("kill-node", node)
    detected_at = serving_at = 0.0
    status: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.status()
        agent = next((a for a in status["agents"] if a["agent_id"] == node), None)
        if not detected_at and agent and agent["state"] == "lost":
            detected_at = agent.get("lost_since") or time.time()
        serving = [r for r in status["replicas"] if r["state"] == "serving" and r["node"] != node]
        if detected_at and len(serving) >= replicas:
            serving_at = time.time()
            break
        time.sleep(0.2)
    stream.settle()  # requests that were in flight at the move finish
    stream.stop()
    timings = FailoverTimings(killed_at, detected_at, serving_at, stream.sent,
                              stream.sent - len(stream.failed))
    return timings, status


def replacement_site(directory: Path, replicas: int = 3, heartbeat: str = "2s", misses: int = 3) -> Path:
    """echo_site with one replica per node at most: a lost node's replica waits for a replacement node."""
    site = echo_site(directory, replicas=replicas, heartbeat=heartbeat, misses=misses)
    data = yaml.safe_load(site.read_text())
    data.setdefault("scheduler", {})["max_replicas_per_node"] = 1
    site.write_text(yaml.safe_dump(data))
    return site


@dataclass
class ReplacementTimings:
    killed_at: float
    detected_at: float = 0.0   # controller declared the node lost
    submitted_at: float = 0.0  # the companion job was in the queue
    joined_at: float = 0.0     # a replacement node's agent said hello
    restored_at: float = 0.0   # every replica serving again, with a replacement node live
    sent: int = 0
    completed: int = 0

    def report(self) -> str:
        def since(t: float) -> str:
            return f"{t - self.killed_at:.2f}s" if t else "never"
        return (f"kill -> detected {since(self.detected_at)}, -> companion job {since(self.submitted_at)}, "
                f"-> replacement joined {since(self.joined_at)}, -> all replicas serving "
                f"{since(self.restored_at)}; requests sent {self.sent}, completed {self.completed}")


def kill_and_watch_replacement(job: Job, node: str, planned: list[str], replicas: int, stream: RequestStream,
                               timeout: float = 150.0) -> tuple[ReplacementTimings, dict]:
    """Kill `node` of a job started with --replace-lost-nodes while `stream` runs; watch it come back."""
    from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError
    from exaserve_hpc.batch.slurm.companion_jobs import companion_name

    client = CliSlurmClient()
    t = ReplacementTimings(killed_at=time.time())
    cluster("kill-node", node)
    status: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not t.restored_at:
        try:
            status = job.status()
        except (httpx.HTTPError, ValueError):  # the gateway is busy on two shared cores: ask again
            time.sleep(0.5)
            continue
        agents = {a["agent_id"]: a["state"] for a in status["agents"]}
        if not t.detected_at and agents.get(node) == "lost":
            t.detected_at = time.time()
        if not t.submitted_at:
            try:
                if any(j.name == companion_name(str(job.job_id)) for j in client.jobs()):
                    t.submitted_at = time.time()
            except SlurmError:
                pass
        if not t.joined_at and any(a not in planned and s == "alive" for a, s in agents.items()):
            t.joined_at = time.time()
        serving = [r for r in status["replicas"] if r["state"] == "serving" and r["node"] != node]
        if t.joined_at and len(serving) >= replicas:
            t.restored_at = time.time()
        time.sleep(0.3)
    stream.settle()
    stream.stop()
    t.sent, t.completed = stream.sent, stream.sent - len(stream.failed)
    return t, status
