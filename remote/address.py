"""``host:port`` strings, as every command and the tracker address take them."""
from __future__ import annotations


def split_address(address: str, default_port: int):
    """``"host:port"`` or ``"host"`` to (host, port).

    >>> split_address("farm.local:9190", 1), split_address("[::1]:5", 1), split_address("pi", 9090)
    (('farm.local', 9190), ('::1', 5), ('pi', 9090))
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, default_port
    return host.strip("[]"), int(port)
