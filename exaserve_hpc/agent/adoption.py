"""What a new leader keeps when several routers share the fleet (`ha.etcd` with `router.count` > 1): pure.

Router k and its gateway run on rank k for the whole run, whoever leads (app/router_rank.py's
RankRouter, started by app/ha_rank.py). A new leader therefore does not make a router: it uses the one of
its own rank and adopts the others' registrations (JOBDIR/routers/rank-K.json), leaving out a lost node's.
A replica keeps running when every router the new leader's fleet names is one it is already connected
to: the routers that survived are, so it goes on serving them; only the lost router's link is left idle
(its sends are non-blocking and dropped, agent/router_links.py).

    adoptable_ranks(count=3, own_rank=1)                     -> [0, 2]
    former_leaders({"node": "nodeb", "former_nodes": ["nodea"]}, "nodec")  -> ["nodea", "nodeb"]
    adopt(info, tag="j.0", lost_nodes={"nodea"})            -> False for the old leader's router
    must_restart(running=[r0, r1, r2], wanted=[r1, r2])      -> False: kept, serving r1 and r2
    must_restart(running=[r0], wanted=[r1])                  -> True: one router, and it changed
"""

from __future__ import annotations

from typing import Iterable, Optional


def adoptable_ranks(count: int, own_rank: int) -> list[int]:
    """The router ranks whose registrations a leader on `own_rank` looks for (its own router is local)."""
    return [k for k in range(count) if k != own_rank]


def adopt(info: Optional[dict], tag: str, lost_nodes: Iterable[str] = ()) -> bool:
    """Whether a registration names a router of this run on a node not known to be lost."""
    return bool(info) and info.get("run") == tag and info.get("node") not in set(lost_nodes)


def former_leaders(published: dict, own_node: str) -> list[str]:
    """The nodes of the leaders before this one, from what the last put under the job's controller key
    (its node, and the former nodes it had itself left out): their routers are not adopted (a failover
    is a leader's node lost, or cut off from etcd). This leader's own node is never among them."""
    nodes = set(published.get("former_nodes") or ()) | {published.get("node")}
    return sorted(n for n in nodes if n and n != own_node)


def backends(router_backend: str, router_backends: Iterable[str]) -> list[str]:
    """A StartReplica's routers: its list, or its one backend (one router)."""
    return list(router_backends) or [router_backend]


def must_restart(running: Iterable[str], wanted: Iterable[str]) -> bool:
    """A replica connected to `running` is asked to serve `wanted`: restart it only when some wanted router is
    one it cannot reach (connections are made at its start). Every wanted router already connected: keep it."""
    wanted = set(wanted)
    return not wanted or not wanted <= set(running)
