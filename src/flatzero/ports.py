"""A free TCP port on localhost: the rendezvous of a process group started without a
launcher (``flatzero.initialize`` alone, ``launch.run_ranks``)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port that was free a moment ago on every local address: c10d's store listens
    on all of them, so a port free on 127.0.0.1 alone (another socket's on another
    address) would not do."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
