"""Where listeners bind and what they publish: interface names, local addresses, never a wildcard."""

from __future__ import annotations

import pytest

from exaserve_hpc.addresses import (
    AddressError, choose_bind, http_url, local_interfaces, publish_host, resolve_listen,
)

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.7"], "ib0": ["10.1.0.7", "fd00::7"], "down0": []}


def test_an_interface_name_binds_its_first_address():
    assert choose_bind("ib0", TABLE, "router.interface") == "10.1.0.7"
    assert choose_bind("lo", TABLE, "gateway.interface") == "127.0.0.1"


def test_a_local_address_binds_itself_and_a_foreign_one_is_refused_naming_the_setting():
    assert choose_bind("192.0.2.7", TABLE, "gateway.interface") == "192.0.2.7"
    assert choose_bind("[fd00::7]", TABLE, "gateway.interface") == "fd00::7"
    with pytest.raises(AddressError, match=r"gateway.interface: 10.9.9.9 is not an address of this node.*ib0"):
        choose_bind("10.9.9.9", TABLE, "gateway.interface")


def test_a_missing_or_addressless_interface_is_a_clear_error():
    with pytest.raises(AddressError, match=r"router.interface: no interface 'ib1' on this node; allowed: .*eth0"):
        choose_bind("ib1", TABLE, "router.interface")
    with pytest.raises(AddressError, match="interface down0 has no address"):
        choose_bind("down0", TABLE, "router.interface")


def test_a_wildcard_is_published_as_the_nodes_own_address_never_as_itself():
    assert publish_host("0.0.0.0", ["10.1.0.7"], TABLE) == "10.1.0.7"  # the node name resolves here
    assert publish_host("0.0.0.0", ["127.0.1.1"], TABLE) == "192.0.2.7"  # /etc/hosts maps it to loopback
    assert publish_host("0.0.0.0", ["10.5.5.5"], TABLE) == "192.0.2.7"  # resolves, but not to this node
    assert publish_host("::", [], {"lo": ["127.0.0.1"]}) == "127.0.0.1"  # a machine alone
    assert publish_host("10.1.0.7", [], TABLE) == "10.1.0.7"


def test_urls_bracket_ipv6():
    assert http_url("fd00::7", 8000) == "http://[fd00::7]:8000"
    assert http_url("10.1.0.7", 0) == "http://10.1.0.7:0"


def test_resolve_listen_on_this_machine():
    table = local_interfaces()
    assert "127.0.0.1" in table["lo"]
    assert resolve_listen(None, "lo", "localhost", "gateway.interface", True) == ("127.0.0.1", "127.0.0.1")
    assert resolve_listen("localhost", None, "localhost", "gateway.host", False)[0] == "127.0.0.1"
    bind, publish = resolve_listen("0.0.0.0", None, "localhost", "gateway.host", True)
    assert bind == "0.0.0.0" and publish not in ("0.0.0.0", "")
    bind, publish = resolve_listen(None, None, "localhost", "router.host", True)
    assert bind == publish and bind != "0.0.0.0"  # under launch: the node's address, bound and published
    with pytest.raises(AddressError, match="gateway.interface: no interface 'nosuch0'"):
        resolve_listen(None, "nosuch0", "localhost", "gateway.interface", True)
