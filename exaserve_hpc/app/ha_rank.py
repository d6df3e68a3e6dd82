"""`exaserve launch` with `ha.etcd`: controller candidates elected through etcd instead of rank 0 alone.

Every rank: its etcd member when its rank is below `ha.etcd.members` (all members must be named before any
starts, so each writes its spec to JOBDIR/etcd/restart-N/ and waits for the others), and its node's agent,
which follows whichever controller controller.json names (follow.py). Ranks below `ha.candidates` also
campaign (election.py). The one elected builds the control plane (app/control_plane.py, the same as rank 0's
without HA, with this node's agent already running), gates its controller on the lease
(`controller.acting = election.acting`), restores the fleet state from etcd (fleet_store.py; else the
HDF5 checkpoint as before), writes it back when it changes, and publishes itself in controller.json and
under the job's etcd prefix. A deposed leader closes its plane without draining anything (the fleet is
the new leader's) and campaigns again; a stopped job (signal, requeue) stops as without HA and resigns, so
no standby takes over a fleet being stopped. Rank 0 campaigns first; the others wait for the first
controller.json (or two lease periods), so the usual leader is where it is without HA.

With `router.count` N > 1, ranks 0 .. N-1 each run router k and gateway k for the whole run (RankRouter,
app/router_rank.py), registered before their agent connects. The leader's plane takes its own rank's
router as its local one and adopts the others' but a lost node's (adoption.py); replicas whose routers
survive are kept, so the surviving gateways serve on through the loss of the leader's node.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from exaserve_hpc.addresses import AddressError, resolve_listen
from exaserve_hpc.agent.adoption import former_leaders
from exaserve_hpc.app.agents import AGENT_STOP_GRACE, build_agent
from exaserve_hpc.app.control_plane import ControlPlane, ControlPlaneError, PlaneSettings
from exaserve_hpc.app.controller_lost import end_if_batch_host_lost
from exaserve_hpc.app.requeue_watch import start_requeue_watch
from exaserve_hpc.app.router_rank import RankRouter, check_router_count, router_keys
from exaserve_hpc.bootstrap import ControllerInfo, NodeInventory, publish_controller
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.ha.election import Deposed, Election
from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable
from exaserve_hpc.ha.etcd_member import EtcdMember, EtcdMemberError, MemberSpec
from exaserve_hpc.ha.etcd_tls import TlsError, TlsFiles, ensure_ca, issue
from exaserve_hpc.ha.fleet_store import FleetStateWriter, read_state
from exaserve_hpc.ha.follow import LeaderFollower, current_controller, failed_start
from exaserve_hpc.ha.lease_policy import LeaseTiming
from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.batch import JobEnvironment
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.batch.slurm.accounts import check_quota_accounts
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, CurveKeys, curve_available, make_curve_keys

log = logging.getLogger("exaserve.ha")


def etcd_prefix(job_id: str) -> str:
    """The job's keys; the same across requeues of one job id."""
    return f"/exaserve/{job_id}"


def member_data_root(configured: Optional[str]) -> Path:
    """Node-local by default ($TMPDIR, else /tmp): etcd fsyncs every write, which a shared filesystem makes slow
    enough to cost elections. The cluster lives for one run, so nothing there needs to outlive the node."""
    return Path(os.path.expandvars(configured)).expanduser() if configured else \
        Path(os.environ.get("TMPDIR") or "/tmp") / f"exaserve-etcd-{os.getuid()}"


def member_data_dir(configured: Optional[str], rank: RankInfo, name: str) -> Path:
    """ROOT/JOB-RESTART/NAME (member_data_root); a stopped member removes it and JOB-RESTART once empty."""
    return member_data_root(configured) / f"{rank.job_id}-{rank.restart}" / name


def start_etcd(site: SiteConfig, rank: RankInfo, jobdir: JobDir,
               timeout: float) -> tuple[Optional[EtcdMember], list[str], Optional[TlsFiles]]:
    """This rank's member when it runs one, every member's client URL (a centre's endpoints as given), and the
    TLS files clients present (None: plain http). With tls, rank 0 makes the run's CA and the client
    certificate before it names its member, so every rank finds them once all members are named."""
    cfg = site.ha.etcd
    if cfg.endpoints:
        files = [str(Path(os.path.expandvars(f)).expanduser()) for f in (cfg.ca_file, cfg.cert_file, cfg.key_file)]
        return None, list(cfg.endpoints), TlsFiles(*files) if cfg.ca_file else None
    if rank.size < cfg.members:
        raise BootstrapError(f"ha.etcd.members is {cfg.members} but the job has {rank.size} ranks; allowed: at most "
                             "the job's nodes (one member a node)")
    run = f"etcd/restart-{rank.restart}"
    (jobdir.path / run).mkdir(parents=True, exist_ok=True, mode=0o700)
    pki = jobdir.path / run / "pki"
    try:
        if cfg.tls and rank.rank == 0:
            issue(pki, "client", ensure_ca(pki))
    except TlsError as exc:
        raise BootstrapError(f"ha.etcd.tls: {exc}") from exc
    if rank.rank < cfg.members:
        try:
            _, host = resolve_listen(None, cfg.interface or site.router.interface, rank.node,
                                     "ha.etcd.interface" if cfg.interface else "router.interface", True)
        except AddressError as exc:
            raise BootstrapError(str(exc)) from exc
        spec = MemberSpec(f"etcd-{rank.rank}", host, cfg.client_port, cfg.peer_port,
                          str(member_data_dir(cfg.data_dir, rank, f"etcd-{rank.rank}")), tls=cfg.tls)
        jobdir.write_json(f"{run}/member-{rank.rank}.json", spec.to_json())
    deadline = time.monotonic() + timeout
    specs: list[Optional[MemberSpec]] = [None] * cfg.members
    while time.monotonic() < deadline and not all(specs):
        for i in range(cfg.members):
            data = specs[i] or jobdir.read_json(f"{run}/member-{i}.json")
            specs[i] = data if isinstance(data, MemberSpec) else (MemberSpec(**data) if data else None)
        if not all(specs):
            time.sleep(0.2)
    missing = [i for i, spec in enumerate(specs) if spec is None]
    if missing:
        raise BootstrapError(f"rank {rank.rank}: etcd members of ranks {missing} did not report within "
                             f"{timeout:.0f}s in {jobdir.path / run}")
    client = TlsFiles(str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key")) if cfg.tls else None
    member = None
    if rank.rank < cfg.members:
        spec = specs[rank.rank]
        try:
            own = issue(pki, spec.name, (pki / "ca.crt", pki / "ca.key"), ips=[spec.host]) if cfg.tls else None
        except TlsError as exc:
            raise BootstrapError(f"ha.etcd.tls: {exc}") from exc
        member = EtcdMember(spec, specs, token=f"exaserve-{rank.job_id}-{rank.restart}", tls=own, client_tls=client,
                            log_path=jobdir.path / run / f"{spec.name}.log", remove_data=True,
                            data_root=member_data_root(cfg.data_dir)).start()
        try:
            member.wait_ready(timeout)
        except EtcdMemberError as exc:
            member.stop()
            raise BootstrapError(str(exc)) from exc
    return member, [spec.client_url for spec in specs], client


def job_curve_keys(jobdir: JobDir) -> CurveKeys:
    """The job's CURVE keys: made by the first leader, reused by every later one, so agents and replicas keep
    the keys they hold across a failover."""
    keys = jobdir.path / "keys"
    try:
        found = CurveKeys(*((keys / name).read_bytes() for name in ("server.pub", "server.key", "client.pub",
                                                                     "client.key")))
    except OSError:
        found = make_curve_keys(jobdir)
    install_block_hash_salt(jobdir)  # the job's salt, kept across failovers as the keys are
    return found


class Candidate:
    """One rank of an HA job: agent (following the leader), and, below ha.candidates, a candidate."""

    def __init__(self, site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                 inventories: list[NodeInventory], args: argparse.Namespace, etcd: EtcdClient):
        self.site, self.job, self.rank, self.jobdir, self.args, self.etcd = site, job, rank, jobdir, args, etcd
        self.nodes = [inv.node for inv in inventories]
        self.prefix = etcd_prefix(rank.job_id)
        self.timing = LeaseTiming.from_settings(site.ha.lease_ttl, site.ha.renew_interval)
        self.agent = None
        self.agent_thread: Optional[threading.Thread] = None
        self.follower: Optional[LeaderFollower] = None
        self.plane = None
        self.rank_router = None  # router k + gateway k on rank k < router.count: the rank's, whoever leads
        self.stop_asked = False
        self.stopped_the_job = False  # this rank led when the run stopped (signal, requeue, stop file)
        self.elected = threading.Event()
        self.election = Election(etcd, self.prefix, f"rank{rank.rank}@{rank.node}", self.timing,
                                 on_elected=lambda e: self.elected.set(), on_deposed=self._deposed,
                                 info={"rank": rank.rank, "node": rank.node})

    # ---------------------------------------------------------------- agent

    def ensure_agent(self, info: ControllerInfo) -> None:
        if self.agent is not None:
            return
        self.agent = build_agent(info, self.site, self.rank, self.jobdir)
        self.agent_thread = threading.Thread(target=self.agent.run, name="exaserve-agent", daemon=True)
        self.agent_thread.start()
        self.follower = LeaderFollower(self.agent, self.jobdir, self.rank).start()
        print(f"exaserve: rank {self.rank.rank} on {self.rank.node}: agent joined {info.endpoint}", flush=True)

    def ensure_router(self, keys: Optional[CurveKeys]) -> None:
        """Router k and gateway k (router.count > 1, rank k < N), registered before this rank's agent
        connects (placement waits for every agent, so the leader knows every router before replicas start).
        Started once: a leader uses it as its local router; losing or winning the lead leaves it serving."""
        if self.rank_router is None and self.site.router.count > 1 and self.rank.rank < self.site.router.count:
            self.rank_router = RankRouter(self.site, self.rank, self.jobdir, self.args, keys,
                                          lambda: current_controller(self.jobdir, self.rank))
            self.rank_router.register()

    def _on_stop_signal(self, sig, frame) -> None:
        """Before this rank leads: a stop is the leader's to order, else the agent drains after a grace."""
        print(f"exaserve: {signal.Signals(sig).name}: stopping (by the leader's order, or in "
              f"{AGENT_STOP_GRACE:.0f}s)", flush=True)
        self.stop_asked = True
        if self.rank_router is not None:  # this gateway stops taking requests at once (as a router rank's)
            self.rank_router.stop_gateway()
        signal.setitimer(signal.ITIMER_REAL, AGENT_STOP_GRACE)

    def _grace_over(self, *_) -> None:
        if self.agent is not None:
            self.agent.shutdown(10.0)

    # ---------------------------------------------------------------- leading

    def _deposed(self, why: str) -> None:
        plane = self.plane
        if plane is not None:
            plane.abandon(f"lost the leadership: {why}")

    def lead(self) -> tuple[int, bool]:
        """Run the control plane while leading: (exit code, whether it ended by deposition)."""
        previous = current_controller(self.jobdir, self.rank)
        nodes = list(previous.nodes) if previous else self.nodes
        expected = nodes or None
        published: dict = {}  # what the leader before this one (a failover) put under the controller key
        if previous is not None:  # a failover: placement waits for every node but the former leaders'
            try:
                kv = self.etcd.get(f"{self.prefix}/controller")
                published = json.loads(kv.value) if kv else {}
            except (EtcdUnavailable, ValueError):
                published = {}
        lost = former_leaders(published, self.rank.node)  # their routers are not adopted
        if previous is not None:  # and placement does not wait for their agents
            expected = [n for n in nodes if n not in lost] or None
        keys = job_curve_keys(self.jobdir) if not self.args.no_curve and curve_available() else None
        self.ensure_router(keys)
        local = self.rank_router
        resume = self.job.resume_dir()
        check_quota_accounts(self.site)
        try:
            state = read_state(self.etcd, self.prefix)  # the previous leader's, if there was one
        except (EtcdUnavailable, ValueError) as exc:
            state = None
            log.warning("fleet state not read from etcd (%s); starting from the checkpoint or the plan", exc)
        try:
            plane = ControlPlane(self.site, PlaneSettings(
                node=self.rank.node, state_dir=self.jobdir.path, job_id=self.rank.job_id, restart=self.rank.restart,
                across_nodes=True, host=self.args.host, curve=keys, expected_agents=expected,
                # with this rank's gateway k on gateway.port, the leader's own (admin, fleet status) takes any port
                port=0 if local is not None else self.args.port,
                local_router=local.router if local else None, local_gateway=local.url if local else "",
                local_admission=local.admission if local else None,  # one part of each limit on this rank
                lost_nodes=tuple(lost),
                node_index=self.rank.rank, start_agent=False, show_progress=False,
                replica_env={CURVE_JOB_DIR_VARIABLE: str(self.jobdir.path.absolute())} if keys else {},
                restore_from=(resume,) if resume else (), restore_state=state))
        except Exception as exc:
            if previous is None:  # the first leader: as without HA, every rank stops instead of waiting
                publish_controller(self.rank, self.jobdir, ControllerInfo(
                    job_id=self.rank.job_id, restart=self.rank.restart, endpoint="", nodes=nodes, error=str(exc)))
            raise  # a later leader's failure ends this rank only: another candidate leads
        plane.controller.acting = self.election.acting
        elected_at, endpoints = time.time(), list(self.etcd.endpoints)
        plane.controller.ha_status = lambda: {
            "leader": self.election.candidate, "node": self.rank.node, "elected_at": elected_at,
            "election_revision": self.election.revision, "acting": self.election.acting(),
            "lease_ttl": self.timing.ttl, "etcd": endpoints}
        self.plane = plane
        if state is not None:
            line = (f"restored the fleet state from etcd ({len(state.placement)} replicas, excluded "
                    f"{','.join(state.excluded_nodes) or 'none'})")
            log.warning("%s", line)
            print(f"exaserve: {line}", flush=True)
        if local is not None:  # a stop of the job (not a deposition) stops this rank's gateway taking requests
            plane.add_stop_hook(lambda: None if getattr(plane, "abandoned", "") else local.stop_gateway())
        writer = FleetStateWriter(self.election, self.prefix, plane.keeper.state,
                                  interval=self.site.ha.state_interval).start()
        plane.add_stop_hook(writer.stop)
        watch = start_requeue_watch(plane, self.site, self.job, self.rank, self.jobdir, nodes, self.args)
        if watch is not None:  # deposed: stop watching, and leave the companion jobs to the new leader
            plane.add_stop_hook(lambda: watch.stop(release=not getattr(plane, "abandoned", "")))
        info = ControllerInfo(job_id=self.rank.job_id, restart=self.rank.restart, endpoint=plane.controller.endpoint,
                              gateway_url=plane.url, server_public_key=keys.server_public.decode() if keys else "",
                              nodes=nodes)
        try:
            self.election.fenced_put({f"{self.prefix}/controller": json.dumps(
                {"endpoint": info.endpoint, "gateway_url": info.gateway_url, "node": self.rank.node,
                 "former_nodes": lost})})
        except (Deposed, EtcdUnavailable) as exc:
            plane.abandon(f"could not publish as the leader: {exc}")
        else:
            publish_controller(self.rank, self.jobdir, info)
            self.ensure_agent(info)  # this node's agent, if it had none yet, or it follows within a poll
            print(f"exaserve: rank {self.rank.rank} on {self.rank.node} leads: controller {info.endpoint}, gateway "
                  f"{plane.url}/v1", flush=True)
        code = plane.run()
        self.plane = None
        return code, bool(getattr(plane, "abandoned", ""))

    # ---------------------------------------------------------------- the rank

    @property
    def stopped_key(self) -> str:
        return f"{self.prefix}/stopped/{self.rank.restart}"

    def mark_stopped(self) -> None:
        """The leader stopped the job (a signal, a requeue, a stop file): say so before resigning, so a standby
        that wins the key next does not take over a fleet being stopped."""
        try:
            self.election.fenced_put({self.stopped_key: f"{self.rank.node} {time.time():.0f}"})
        except (Deposed, EtcdUnavailable) as exc:
            log.warning("could not mark the job stopped in etcd: %s", exc)

    def job_stopped(self) -> bool:
        try:
            return self.etcd.get(self.stopped_key) is not None
        except EtcdUnavailable:
            return False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGUSR1, self._on_stop_signal)
        signal.signal(signal.SIGALRM, self._grace_over)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        candidate = self.rank.rank < self.site.ha.candidates
        campaign_after = time.monotonic() + (0 if self.rank.rank == 0 else 2 * self.timing.ttl)
        campaigning = False
        try:
            while True:
                if candidate and not campaigning and not self.stop_asked and (
                        time.monotonic() >= campaign_after or current_controller(self.jobdir, self.rank)):
                    self.election.start()
                    campaigning = True
                if self.agent_thread is not None and not self.agent_thread.is_alive():
                    return self.agent.exit_code  # drained by the leader's stop order, or lost its controller
                if self.elected.is_set() and not self.stop_asked:
                    self.elected.clear()
                    if self.job_stopped():
                        self.stop_asked = True  # the leader stopped the job: this is no failover
                        self.election.stop(resign=True)
                        continue
                    code, deposed = self.lead()
                    if not deposed:
                        self.mark_stopped()
                        self.stopped_the_job = True
                        return code  # the job stopped (signal, requeue): not a failover
                    signal.signal(signal.SIGTERM, self._on_stop_signal)
                    signal.signal(signal.SIGUSR1, self._on_stop_signal)
                    continue
                if self.agent is None:
                    info = current_controller(self.jobdir, self.rank)
                    if info is not None:
                        self.ensure_router(router_keys(self.jobdir, info))
                        self.ensure_agent(info)
                    elif failed_start(self.jobdir, self.rank):
                        raise BootstrapError(f"rank {self.rank.rank} on {self.rank.node}: the first leader could "
                                             f"not start the controller, so this rank stops too: "
                                             f"{failed_start(self.jobdir, self.rank)}")
                time.sleep(0.2)
        finally:
            if campaigning:
                self.election.stop(resign=True)
            if self.follower is not None:
                self.follower.stop()
            if self.agent_thread is not None and self.agent_thread.is_alive():
                self.agent.shutdown(10.0)
                self.agent_thread.join(30)
            if self.rank_router is not None:
                self.rank_router.stop()


def run_ha_rank(site: SiteConfig, job: JobEnvironment, rank: RankInfo, jobdir: JobDir,
                inventories: list[NodeInventory], args: argparse.Namespace) -> int:
    """One rank of `exaserve launch` with `ha.etcd` set (app/rank.py)."""
    if site.router.count > 1:  # router k runs on rank k: every rank says so, so the whole step ends
        try:
            check_router_count(site, rank.size)
        except ControlPlaneError as exc:
            raise BootstrapError(str(exc)) from exc
    member, endpoints, tls = start_etcd(site, rank, jobdir, args.bootstrap_timeout)
    candidate: Optional[Candidate] = None
    try:
        timing = LeaseTiming.from_settings(site.ha.lease_ttl, site.ha.renew_interval)
        etcd = EtcdClient(endpoints, timeout=min(2.0, timing.renew_interval), tls=tls)
        print(f"exaserve: rank {rank.rank} on {rank.node}: etcd {','.join(endpoints)}"
              + (f" (member {member.spec.name} here)" if member else ""), flush=True)
        candidate = Candidate(site, job, rank, jobdir, inventories, args, etcd)
        return candidate.run()
    finally:
        if member is not None:
            member.stop()
        if candidate is not None and candidate.stopped_the_job:  # the leader that stopped the run, last of all:
            end_if_batch_host_lost(job, rank, jobdir, "the run stopped")  # would otherwise stay RUNNING

