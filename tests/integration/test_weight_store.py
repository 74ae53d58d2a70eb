"""The learner's weight rendezvous store (a TCPStore: no authentication) listens only on
the address the learner advertises to rollout servers, never on every interface."""

from __future__ import annotations

import socket

import psutil
import pytest

from services import weight_group


def listening_addresses(port: int) -> set[tuple[str, int]]:
    return {
        tuple(c.laddr)
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def other_local_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (a CI machine may have none)."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_store_listens_only_on_the_advertised_address_and_serves_there():
    store = weight_group.host_store(0, timeout_s=10, host="127.0.0.1")

    assert listening_addresses(store.port) == {("127.0.0.1", store.port)}
    assert not [address for address in other_local_addresses() if reachable(address, store.port)]
    rollout_side = weight_group.connect_store("127.0.0.1", store.port, timeout_s=10)
    rollout_side.set("plan", "v1")
    assert store.get("plan") == b"v1"


def test_an_advertised_address_this_machine_does_not_have_is_an_error_naming_it():
    with pytest.raises(OSError, match="198.51.100.254"):
        weight_group.host_store(0, timeout_s=10, host="198.51.100.254")  # TEST-NET-2: nobody's
