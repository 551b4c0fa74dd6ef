"""A free TCP port, for the rendezvous of every process group the project builds (DeepSpeed worlds, weight sync)."""

import socket

_reserved: dict[int, socket.socket] = {}  # port -> the socket holding it until release_port


def free_port(host: str = "") -> int:
    """A TCP port that is free on `host` (default: every interface of this machine) now; the OS picks it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port() -> int:
    """A free port that stays bound, so that the OS hands it to no other process, until release_port: a world's
    rank 0 picks its port when it starts and binds it only seconds later, when the process group forms, and another
    world or a vLLM engine starting meanwhile on the same node could otherwise be given the same port."""
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    _reserved[port] = s
    return port


def release_port(port: int) -> None:
    """Free a port reserve_port holds in this process, right before the process group binds it (no-op otherwise)."""
    held = _reserved.pop(port, None)
    if held is not None:
        held.close()
