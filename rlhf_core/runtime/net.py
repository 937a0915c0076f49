"""Ports: the one way this project picks a free TCP port."""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1", avoid=lambda port: False) -> list[int]:
    """``count`` distinct ports free on ``host`` now (all held open until every one is
    found, so they differ); ``avoid(port)`` skips ports a caller must not use."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
            port = s.getsockname()[1]
            if port not in ports and not avoid(port):
                ports.append(port)
    finally:
        for s in sockets:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host`` (``""``: every interface, for a rendezvous other nodes reach)."""
    return free_ports(1, host)[0]
