"""Direct ingress with several replicas: each Serve replica serves HTTP on the one API port
(SO_REUSEPORT), so the kernel spreads connections over them and no request crosses Serve's
proxy. A real cluster (Ray, Serve, one CPU backend of the tiny random model), real HTTP clients:

- fresh connections reach both replicas (each names itself in /health);
- the same greedy request streams the same text whichever replica takes it;
- with one replica killed the port keeps answering: the other replica takes every new
  connection at once, and Serve brings the killed one back on the same port; while it starts
  again every fresh connection is answered 200 by a replica that can serve (none is taken by the
  starting one before Serve has initialised it).
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from tests.cluster.conftest import free_port, wait_for
from tests.conftest import is_gone

pytestmark = [pytest.mark.slow,  # starts Ray (CI runs the slow tests too)
              pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                                 reason="SO_REUSEPORT spreads connections on Linux only")]

MODEL = "tiny-llama-random"
REPLICAS = 2
CONNECTIONS = 32  # fresh connections; all on one replica by chance: 2 ** -31


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from tandem.cluster.launcher import start

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    tmp = tmp_path_factory.mktemp("direct")
    rates = tmp / "rates.json"
    rates.write_text(json.dumps({"cpu": {"prefill_tok_s": 20_000.0, "decode_tok_s": 400.0}}))
    handle = start(model=MODEL, backends=["cpu"], cpu_threads=1, max_active=4, port=free_port(),
                   metrics_port=free_port(), rates=str(rates), rates_cache=str(tmp / "cache.json"),
                   profile="never", access_log=False, log=lambda line: None, calibration_alpha=0,
                   ingress="direct", http_replicas=REPLICAS)
    try:
        yield handle
    finally:
        handle.shutdown()


def _replica_of_fresh_connection(url: str) -> str:
    """The replica that answered /health on a new connection. Always 200: a replica that is still
    starting does not listen yet (cluster/http_server.py), so it is never the one that answers."""
    with httpx.Client(timeout=10.0) as client:  # a new connection each time
        response = client.get(url + "/health")
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()["ingress_replica"]


def test_fresh_connections_reach_every_replica(cluster):
    assert cluster.config.ingress == "direct"
    seen = {_replica_of_fresh_connection(cluster.url) for _ in range(CONNECTIONS)}
    assert len(seen) == REPLICAS, seen


def test_streams_agree_whichever_replica_serves_them(cluster):
    body = {"model": MODEL, "prompt": "The same words, again", "max_tokens": 12, "temperature": 0,
            "stream": True, "ignore_eos": True}

    async def one() -> tuple[str, str]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60.0) as client:
            replica = (await client.get("/health")).json()["ingress_replica"]
            text = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            return replica, "".join(text)

    async def many() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one() for _ in range(12)))

    results = asyncio.run(many())
    assert len({text for _, text in results}) == 1, results
    assert results[0][1]
    assert len({replica for replica, _ in results}) == REPLICAS  # 12 connections: both replicas served


def test_a_killed_replica_leaves_the_port_answering(cluster):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "TandemIngress" in a["name"]]
    assert len(names) == REPLICAS, names
    victim = ray.get_actor(names[0], namespace="serve")
    pid = ray.get(victim.__ray_call__.remote(lambda replica: os.getpid()))
    ray.kill(victim, no_restart=True)

    # Its process exited, so the kernel closed its listening socket. (The actor's name goes
    # first, before the process is gone: a connection the kernel put in the dying socket's
    # queue in between is reset, which is what clients of any SO_REUSEPORT server see.)
    wait_for(lambda: is_gone(pid), timeout_s=30, interval_s=0.2, what="the killed replica's process to exit")
    body = {"model": MODEL, "prompt": "Still here?", "max_tokens": 4}
    for _ in range(CONNECTIONS):  # every fresh connection is answered, none refused or reset
        with httpx.Client(timeout=30.0) as client:
            assert client.post(cluster.url + "/v1/completions", json=body).status_code == 200

    def both_back() -> bool:
        return len({_replica_of_fresh_connection(cluster.url) for _ in range(CONNECTIONS)}) == REPLICAS

    wait_for(both_back, timeout_s=120, interval_s=1.0, what="Serve to restart the killed replica on the port")
