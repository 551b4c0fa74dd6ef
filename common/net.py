"""A free TCP port, for the rendezvous of every process group the project builds (DeepSpeed worlds, weight sync)."""

import socket


def free_port(host: str = "") -> int:
    """A TCP port that is free on `host` (default: every interface of this machine) now; the OS picks it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
