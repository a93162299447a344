"""A free TCP port on loopback, for tests whose processes rendezvous over gloo."""

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
