"""The machine as the scheduler sees it: nodes, devices, NVLink domains, fault groups, latency.

A Topology is a frozen snapshot. It is built from a SiteConfig
(`topology_from_site`) before any node has reported, and from the nodes' own
inventory (`topology_from_inventory`: plain dicts gathered at bootstrap from
NVML) once they have. Placement code only ever sees this type.

Devices: a GPU node has one Device per GPU, grouped into NVLink domains (the
whole node, or `cluster.nvlink_domain_size` GPUs each). A CPU node
(`gpus_per_node: 0`) is modelled as ONE device whose memory is the host memory
(`cluster.host_memory`, else `default_host_memory`), in a single domain, so
the same placement code serves CPU replicas.

Latency is an estimate for ordering choices (failover prefers a near node),
not a measurement: same node 0, same fault group `same_group_us`, other group
`other_group_us`; `overrides` replaces the estimate for given node pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from exaserve_hpc.config.schema import ClusterConfig, SiteConfig
from exaserve_hpc.units import parse_size

DEFAULT_HOST_MEMORY = 64 * 2**30  # CPU node memory when neither the config nor the inventory says
SAME_GROUP_US = 2.0  # one switch hop
OTHER_GROUP_US = 10.0  # through the spine

DeviceKind = Literal["gpu", "cpu"]


@dataclass(frozen=True)
class Device:
    index: int  # GPU index on the node (0 for the host device of a CPU node)
    memory: int  # bytes
    kind: DeviceKind = "gpu"


@dataclass(frozen=True)
class Node:
    name: str
    index: int  # position in Topology.nodes
    fault_group: str
    devices: tuple[Device, ...]
    nvlink_domains: tuple[tuple[int, ...], ...]  # device indices; a TP group stays inside one
    host_memory: int
    # replicas its cores can run (CPU nodes serving a CPU engine: controller/cpu_bound.py); 0: no such bound
    cpu_slots: int = 0

    @property
    def is_cpu(self) -> bool:
        return bool(self.devices) and self.devices[0].kind == "cpu"

    @property
    def memory(self) -> int:
        return sum(d.memory for d in self.devices)


@dataclass(frozen=True)
class FaultGroup:
    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    groups: tuple[FaultGroup, ...]
    same_group_us: float = SAME_GROUP_US
    other_group_us: float = OTHER_GROUP_US
    overrides: Mapping[frozenset, float] = field(default_factory=dict)  # {frozenset({a, b}): µs}
    _by_name: dict[str, Node] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {n.name: n for n in self.nodes}
        assert len(by_name) == len(self.nodes), "node names must be unique"
        assert all(n.index == i for i, n in enumerate(self.nodes)), "Node.index must be its position"
        grouped = [h for g in self.groups for h in g.nodes]
        assert sorted(grouped) == sorted(by_name), "every node is in exactly one fault group"
        object.__setattr__(self, "_by_name", by_name)

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"node {name!r} is not in this topology ({len(self.nodes)} nodes)") from None

    def group(self, name: str) -> FaultGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"fault group {name!r} is not one of: {', '.join(g.name for g in self.groups)}")

    def latency_us(self, a: str, b: str) -> float:
        """Estimated one-way latency between two nodes in microseconds."""
        if a == b:
            return 0.0
        if self.overrides:
            hit = self.overrides.get(frozenset((a, b)))
            if hit is not None:
                return hit
        if self._by_name[a].fault_group == self._by_name[b].fault_group:
            return self.same_group_us
        return self.other_group_us

    @property
    def largest_domain(self) -> int:
        return max((len(d) for n in self.nodes for d in n.nvlink_domains), default=0)

    @property
    def largest_group(self) -> int:
        return max((len(g.nodes) for g in self.groups), default=0)

    @property
    def is_cpu(self) -> bool:
        return all(n.is_cpu for n in self.nodes)

    def with_latency(self, same_group_us: float | None = None, other_group_us: float | None = None,
                     overrides: Mapping[tuple[str, str], float] | None = None) -> "Topology":
        """A copy with a different latency estimate (overrides keyed by node-name pairs)."""
        return Topology(
            nodes=self.nodes, groups=self.groups,
            same_group_us=self.same_group_us if same_group_us is None else same_group_us,
            other_group_us=self.other_group_us if other_group_us is None else other_group_us,
            overrides={frozenset(k): v for k, v in (overrides or {}).items()} or dict(self.overrides),
        )


def _domains(device_count: int, domain_size: int | None) -> tuple[tuple[int, ...], ...]:
    size = domain_size or device_count
    return tuple(tuple(range(start, min(start + size, device_count))) for start in range(0, device_count, size))


def _groups_from(nodes: Sequence[Node]) -> tuple[FaultGroup, ...]:
    order: dict[str, list[str]] = {}
    for n in nodes:
        order.setdefault(n.fault_group, []).append(n.name)
    return tuple(FaultGroup(name, tuple(hosts)) for name, hosts in order.items())


def topology_from_site(site: SiteConfig | ClusterConfig, default_host_memory: int = DEFAULT_HOST_MEMORY) -> Topology:
    """The topology the site config describes (every node identical)."""
    cluster = site.cluster if isinstance(site, SiteConfig) else site
    host_memory = cluster.host_memory or default_host_memory
    group_of = cluster.fault_group_of()
    nodes = []
    for i, host in enumerate(cluster.hostnames()):
        if cluster.gpus_per_node:
            devices = tuple(Device(g, cluster.gpu_memory, "gpu") for g in range(cluster.gpus_per_node))
            domains = _domains(cluster.gpus_per_node, cluster.nvlink_domain_size)
        else:
            devices = (Device(0, host_memory, "cpu"),)
            domains = ((0,),)
        nodes.append(Node(host, i, group_of[host], devices, domains, host_memory))
    return Topology(tuple(nodes), _groups_from(nodes))


def _size(value: Any, what: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"inventory {what}: {exc}") from exc


def topology_from_inventory(inventory: Iterable[Mapping[str, Any]], cluster: ClusterConfig | None = None,
                            default_host_memory: int = DEFAULT_HOST_MEMORY) -> Topology:
    """The topology the nodes reported at bootstrap.

    Each entry is a plain dict, as gathered from NVML by the node agents:
    ``{"hostname": "gpu001", "host_memory": 1099511627776, "fault_group": "rack00",
       "gpus": [{"index": 0, "memory": 85899345920, "nvlink_domain": 0}, ...]}``.
    ``fault_group`` falls back to the cluster config's grouping, then to one
    group per node; ``nvlink_domain`` falls back to ``cluster.nvlink_domain_size``,
    then to the whole node. A node with no GPUs becomes one CPU device.
    """
    entries = list(inventory)
    group_of = cluster.fault_group_of() if cluster is not None else {}
    domain_size = cluster.nvlink_domain_size if cluster is not None else None
    nodes = []
    for i, entry in enumerate(entries):
        if "hostname" not in entry:
            raise ValueError(f"inventory entry {i} has no 'hostname' (keys: {sorted(entry)}); each node must report one")
        host = str(entry["hostname"])
        host_memory = _size(entry.get("host_memory") or (cluster.host_memory if cluster else None)
                            or default_host_memory, f"{host}.host_memory")
        gpus = sorted(entry.get("gpus") or [], key=lambda g: int(g["index"]))
        if gpus:
            devices = tuple(Device(int(g["index"]), _size(g["memory"], f"{host}.gpus[{g['index']}].memory"), "gpu")
                            for g in gpus)
            if [d.index for d in devices] != list(range(len(devices))):
                raise ValueError(f"inventory {host}: GPU indices {[d.index for d in devices]} are not 0..{len(devices) - 1}")
            if all("nvlink_domain" in g for g in gpus):
                by_domain: dict[Any, list[int]] = {}
                for g in gpus:
                    by_domain.setdefault(g["nvlink_domain"], []).append(int(g["index"]))
                domains = tuple(tuple(v) for v in by_domain.values())
            else:
                domains = _domains(len(devices), domain_size if domain_size and len(devices) % domain_size == 0 else None)
        else:
            devices = (Device(0, host_memory, "cpu"),)
            domains = ((0,),)
        group = str(entry.get("fault_group") or group_of.get(host) or f"ungrouped-{host}")
        nodes.append(Node(host, i, group, devices, domains, host_memory, int(entry.get("cpu_slots") or 0)))
    return Topology(tuple(nodes), _groups_from(nodes))
