"""Each ingress replica's own HTTP server, all of them on the one API port.

Why not Serve's HTTP proxy: every request would cross one more process (the proxy parses the
HTTP, then makes a Ray call into a replica and relays each streamed chunk back), and that one
proxy per node is a serial resource shared by every replica. Why not Serve's direct ingress: it
gives each replica a port of its own, so the API port is served by one process, and one Python
process is what caps a server's request rate and streamed chunks per second.

So each replica binds the API port itself with `SO_REUSEPORT`, and the kernel spreads incoming
connections over the replicas' listening sockets. Serve still deploys, health-checks, restarts
and scales the replicas; only the bytes skip its proxy. A replica runs uvicorn on the event loop
that runs the app, so no ASGI message crosses between threads. Linux balances connections
between `SO_REUSEPORT` sockets; other systems let several bind but send everything to one, so
there a single replica serves (`shared_port_balances`).

A replica binds the port when it is constructed (a port that another program holds fails it at
once) but listens only once Serve has finished initialising it (`ready()`): the kernel hands new
connections only to listening sockets, so until then they go to the replicas already serving, or,
with none, are refused, which every HTTP client retries. Listening from the constructor on would
accept requests that Serve cannot yet route to the replica's object: `/health` would answer 503
and the API a 500 for the moment in between, at every start and every restart of a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

logger = logging.getLogger("tandem.http")

KEEP_ALIVE_S = 65  # longer than common clients' pools keep idle connections (aiohttp 15 s, httpx 5 s)
BACKLOG = 4096  # connections the kernel queues per replica before accept; bursts of clients open many
READY_POLL_S = 0.02  # how often a replica that is starting checks whether it can serve yet


def shared_port_balances() -> bool:
    """Whether this system spreads one port's connections over several listening sockets."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def bind_shared(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening, that other processes of this user may
    bind too."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the replica's process belongs to Ray."""

    def capture_signals(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class ReplicaHTTPServer:
    """Serves `app` (an ASGI callable) on a socket bound now, on the running event loop, for
    the life of the replica's process (its socket closes with it), from the moment `ready()` is
    true."""

    def __init__(self, app: Any, host: str, port: int, ready: Callable[[], bool]) -> None:
        self.sock = bind_shared(host, port)  # now: a port someone else holds fails the replica at once
        self.ready = ready
        config = uvicorn.Config(app, interface="asgi3", lifespan="off", proxy_headers=False, access_log=False,
                                log_config=None, log_level=None, timeout_keep_alive=KEEP_ALIVE_S, backlog=BACKLOG)
        self.server = _Server(config)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while not self.ready():
                await asyncio.sleep(READY_POLL_S)
            self.sock.listen(BACKLOG)
            await self.server.serve(sockets=[self.sock])
        except Exception:
            logger.exception("the HTTP server of this ingress replica stopped")
            raise


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return ":" in host
