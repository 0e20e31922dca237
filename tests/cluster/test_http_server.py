"""The shared API port, without Ray (milliseconds): replicas bind it together; a process that
did not ask to share it cannot take it from them."""

from __future__ import annotations

import socket

import pytest

from tandem.cluster.http_server import bind_shared
from tests.cluster.conftest import free_port


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT here")
def test_replicas_share_the_port_and_others_cannot_take_it():
    port = free_port()
    first, second = bind_shared("127.0.0.1", port), bind_shared("127.0.0.1", port)
    try:
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the kernel queues it on one of them
            pass
    finally:
        first.close()
        second.close()

