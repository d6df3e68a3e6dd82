"""Where a listener binds and which address it publishes: interface names, local addresses, node names.

    table = local_interfaces()                         # {"lo": ["127.0.0.1", "::1"], "ib0": ["10.1.0.7"], ...}
    choose_bind("ib0", table, "router.interface")      # "10.1.0.7"
    publish_host("0.0.0.0", node_addresses("n7"), table)  # the node's routable address, never a wildcard
    http_url("fe80::1", 8000)                          # "http://[fe80::1]:8000"

Under `exaserve launch` every other node (and a login node) connects to what rank 0 publishes, so a
published address must be one of this node's addresses that others can route to: never 0.0.0.0, and
on a cluster with several networks the one the site names (`router.interface: ib0`). The choosing is
pure (tables in, address out); only local_interfaces() and node_addresses() look at the machine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path
from typing import Optional

WILDCARDS = ("0.0.0.0", "*", "::", "[::]", "")
SIOCGIFADDR = 0x8915


class AddressError(ValueError):
    """A configured interface or address this node does not have; the message names the setting."""


def is_wildcard(host: Optional[str]) -> bool:
    return (host or "") in WILDCARDS


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback


def choose_bind(value: str, interfaces: dict[str, list[str]], setting: str) -> str:
    """The address to bind for `value` (an interface name or a local address), else AddressError."""
    value = value.strip()
    if is_wildcard(value):
        return "0.0.0.0" if value in ("0.0.0.0", "*", "") else "::"
    if _is_address(value):
        address = value.strip("[]")
        if any(ipaddress.ip_address(address) == ipaddress.ip_address(a.split("%")[0])
               for addresses in interfaces.values() for a in addresses):
            return address
        raise AddressError(f"{setting}: {value} is not an address of this node; it has "
                           f"{describe(interfaces)}")
    if value in interfaces:
        if not interfaces[value]:
            raise AddressError(f"{setting}: interface {value} has no address on this node (is it up?)")
        return interfaces[value][0]
    raise AddressError(f"{setting}: no interface {value!r} on this node; allowed: an interface name or a "
                       f"local address ({describe(interfaces)})")


def describe(interfaces: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({', '.join(a) or 'no address'})" for name, a in sorted(interfaces.items()))


def publish_host(bound: str, node_addrs: list[str], interfaces: dict[str, list[str]]) -> str:
    """What peers connect to for a listener bound to `bound`.

    A concrete address is published as it is. A wildcard is published as the address the node's
    name resolves to when that address is this node's (node names resolve on every node of a
    cluster), else this node's first address off loopback, else loopback (a machine alone).
    """
    if not is_wildcard(bound):
        return bound
    local = [a for addresses in interfaces.values() for a in addresses]
    local_set = {a.split("%")[0] for a in local}
    for address in node_addrs:
        if address in local_set and not _loopback(address):
            return address
    for name in sorted(interfaces, key=lambda n: (n == "lo", n)):
        for address in interfaces[name]:
            if not _loopback(address) and not address.lower().startswith("fe80"):
                return address
    return "127.0.0.1"


def host_literal(host: str) -> str:
    """IPv6 addresses in brackets, as URLs and ZeroMQ endpoints need them."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def http_url(host: str, port: int) -> str:
    return f"http://{host_literal(host)}:{port}"


# ---------------------------------------------------------------- the machine


def local_interfaces() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 first, then global IPv6) on this node."""
    table: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in table:
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            table[name].append(socket.inet_ntoa(raw[20:24]))
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # address ifindex prefixlen scope flags name
        parts = line.split()
        if len(parts) == 6 and parts[5] in table and parts[3] in ("00", "10"):  # global or host (::1)
            table[parts[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return table


def node_addresses(node: str) -> list[str]:
    """What `node` (e.g. SLURMD_NODENAME) resolves to here; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(node, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def resolve_listen(configured: Optional[str], interface: Optional[str], node: str, setting: str,
                   across_nodes: bool) -> tuple[str, str]:
    """(bind, publish) for one listener: `interface` wins, then `configured` (a host setting);
    under launch with neither, the node's own address (others reach it, loopback does not)."""
    table = local_interfaces()
    if interface:
        bound = choose_bind(interface, table, setting)
    elif configured and not (is_wildcard(configured) or _is_address(configured) or configured in table):
        local = {a for addresses in table.values() for a in addresses}
        named = [a for a in node_addresses(configured) if a in local]  # a host name, e.g. localhost
        bound = named[0] if named else choose_bind(configured, table, setting)
    elif configured:
        bound = configured if is_wildcard(configured) else choose_bind(configured, table, setting)
    elif across_nodes:
        bound = publish_host("0.0.0.0", node_addresses(node), table)
    else:
        bound = "127.0.0.1"
    return bound, publish_host(bound, node_addresses(node), table)
