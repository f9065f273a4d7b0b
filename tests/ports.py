"""Ports on 127.0.0.1 for the process groups and servers tests start ([Note: free ports])."""

from __future__ import annotations

import os
import socket

#: Ports each pytest-xdist worker draws from ([Note: free ports]).
PORT_BLOCK = 1000
PORT_BASE = 20000
_port_cursor: list[int] = []


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, for a process group's store or a
    server a test starts.

    [Note: free ports]: a port the kernel hands out for ``bind(0)`` comes from the
    ephemeral range, where any new connection (a gloo pair, an HTTP client) may take it
    again between this check and the bind that needs it, and where a test on the other
    xdist worker may draw the same one: that gave rare rendezvous failures ("Connection
    closed by peer" in connectFullMesh) on a loaded machine. So each xdist worker draws
    from a block of its own below the ephemeral range, in turn (the port a call used is
    the last one its worker draws again), and skips ports something holds."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    first = PORT_BASE + index * PORT_BLOCK
    if first + PORT_BLOCK > _ephemeral_low():  # no room below the range: ask the kernel
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if not _port_cursor:
        _port_cursor.append(os.getpid() % PORT_BLOCK)  # processes of one worker differ
    for _ in range(PORT_BLOCK):
        port = first + _port_cursor[0] % PORT_BLOCK
        _port_cursor[0] += 1
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORT_BLOCK - 1}")
