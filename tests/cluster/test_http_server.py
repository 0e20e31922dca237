"""The shared API port, without Ray (milliseconds): replicas bind it together; a process that
did not ask to share it cannot take it from them; a replica that is still starting takes no
connection until it can serve (the start-up window: bound, not listening), so fresh connections
go to the replicas that are ready, or are refused when there is none, never answered by a
replica that cannot route them yet."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from tandem.cluster.http_server import ReplicaHTTPServer, bind_shared
from tests.cluster.conftest import free_port

CONNECTIONS = 32  # fresh connections; all on one of two listening replicas by chance: 2 ** -31

needs_reuseport = pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT here")


@needs_reuseport
def test_replicas_share_the_port_and_others_cannot_take_it():
    port = free_port()
    first, second = bind_shared("127.0.0.1", port), bind_shared("127.0.0.1", port)
    try:
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: nobody takes it yet
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        first.listen(8)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the kernel queues it on the listener
            pass
    finally:
        first.close()
        second.close()


def _app(name: str):
    """An ASGI app that answers every request with its replica's name."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name.encode()})

    return app


async def _fresh_get(url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as client:  # a new connection each time
        response = await client.get(url)
        assert response.status_code == 200
        return response.text


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@needs_reuseport
def test_a_replica_that_is_not_ready_takes_no_connection():
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"

    async def scenario() -> None:
        ready = {"a": False, "b": False}
        servers = [ReplicaHTTPServer(_app(name), "127.0.0.1", port, lambda name=name: ready[name])
                   for name in ready]
        try:
            await asyncio.sleep(0.2)  # both bound, their serve tasks polling
            # None ready: the port refuses the connection (clients retry), nothing answers for them.
            with pytest.raises(httpx.ConnectError):
                await _fresh_get(url)
            # One ready: it takes every fresh connection; the one still starting takes none.
            ready["a"] = True
            await _until(lambda: servers[0].server.started)
            assert {await _fresh_get(url) for _ in range(CONNECTIONS)} == {"a"}
            # Both ready: the kernel spreads fresh connections over both.
            ready["b"] = True
            await _until(lambda: servers[1].server.started)
            assert {await _fresh_get(url) for _ in range(CONNECTIONS)} == {"a", "b"}
        finally:
            for server in servers:
                server.server.should_exit = True
            await asyncio.gather(*(server.task for server in servers), return_exceptions=True)
            for server in servers:
                server.sock.close()

    asyncio.run(scenario())
