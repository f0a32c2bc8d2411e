#!/usr/bin/python3
"""Free loopback ports for test clusters, picked below the kernel's ephemeral
range (/proc/sys/net/ipv4/ip_local_port_range). A port the kernel hands out for
`port = 0` listeners or outgoing connections comes from that range, so a port
chosen here and bound a moment later by a node cannot be taken in between by
another node's ephemeral socket (CI saw "Address already in use" when test
ports came from the same range). The same rule as free_loopback_port() in
tests/cluster/child_process.cpp.

usage: ports.py [N]   prints N (default 1) distinct free ports, one a line"""

import random
import socket
import sys

LOWEST = 10000
_given = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port in [LOWEST, ephemeral low) that binds now and was not given before in this process."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(LOWEST, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{LOWEST}, {high})")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
        print(free_port())
