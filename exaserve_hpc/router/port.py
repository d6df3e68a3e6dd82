"""What the controller, the control plane and the simulator use of "the router": one protocol, `RouterPort`.

Every router kind implements it, so nothing probes a router with getattr:

    ZmqRouter     one router thread in this process (router/zmq_router.py)
    RouterGroup   several routers sharing the fleet: this process's and other ranks' (router/router_group.py)
    RemoteRouter  a router of another rank, seen through its control link (router/router_link.py)
    SimRouters    the simulator's routers in simulated time (sim/routers.py)

A RouterGroup's members are RouterPorts too (ZmqRouter or RemoteRouter), which is how the group fans the
controller's news out and asks whether any still routes. `app/router_rank.RankRouter` is not a router
kind: it is rank k's service running a ZmqRouter and its gateway. Tests' stand-ins subclass `RouterPortStub`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RouterPort(Protocol):
    @property
    def frontend_endpoint(self) -> str:
        """Where gateways connect (router 0's in a group)."""

    @property
    def backend_endpoint(self) -> str:
        """Where replicas connect (router 0's in a group)."""

    @property
    def backend_endpoints(self) -> list[str]:
        """Every router's backend, router 0 first; one entry for a single router."""

    def routing(self) -> bool:
        """False once its routing loop has stopped (in a group: once none routes): /health says so."""

    def snapshot(self) -> dict:
        """Its state for status and metrics: replicas (queue depth, in flight), counters, replica_silent_s."""

    def replica_lost(self, replica_id: str, cause: str) -> None:
        """The replica left (failed, stopped, its node lost): route nothing more to it; resend what it held."""

    def drain(self, replica_id: str) -> None:
        """Route nothing new to the replica; it finishes what it holds."""


class RouterPortStub:
    """A RouterPort that routes nothing, for tests of the controller: records what it is told."""
    frontend_endpoint = "tcp://127.0.0.1:2"
    backend_endpoint = "tcp://127.0.0.1:1"

    @property
    def backend_endpoints(self) -> list[str]:
        return [self.backend_endpoint]

    def routing(self) -> bool:
        return True

    def snapshot(self) -> dict:
        return {"replicas": []}

    def replica_lost(self, replica_id: str, cause: str) -> None:
        pass

    def drain(self, replica_id: str) -> None:
        pass
