"""Chaos against a real cluster: clients that hang up at any moment, time out early, or arrive
in a burst past the admission limit, and a backend killed mid-stream. Nobody else may notice.

The cluster is its own (Ray, Serve over HTTP, two CPU backends of the tiny random model, one
torch thread each), started once for this module and shut down after it, so it stays cheap
on 2 cores and the session cluster of the other HTTP tests starts fresh after it. Clients are
httpx on asyncio, dozens at once. What is checked:

- bystanders, greedy streams that run throughout, finish byte-identical to an undisturbed run
  of the same requests (so a disconnect, a 429 or a dead neighbour never touches their text);
- clients that hang up see nothing from the server but data events (no error event, no 5xx);
- a burst past the limit gets 429s with an OpenAI body and `Retry-After`, nothing else;
- afterwards the cluster is idle everywhere it keeps state: no request running or waiting and
  no KV block used on any backend, no stream left in a backend actor, nothing in the router's
  ledger, the router's pending gauges at 0, the ingress's pending count at 0; and no backend
  restarted except one a test killed (the `instance_id` a backend's ping returns).

The default run takes a few tens of seconds. The long run (`-m chaos_long`, skipped unless
TANDEM_CHAOS_LONG=1) sends hundreds of clients in waves and a bigger burst; run it with `-s`
to see its numbers, which every test prints as one JSON line starting with "CHAOS".
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.cluster.conftest import free_port, wait_for

pytestmark = pytest.mark.slow  # starts Ray (CI runs the slow tests too)

MODEL = "tiny-llama-random"
MAX_ACTIVE = 8
PENDING_LIMIT = 48
TIMEOUT_S = 60.0
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG = os.environ.get("TANDEM_CHAOS_LONG") == "1"


@dataclass(frozen=True)
class Scale:
    num_clients: int  # clients that hang up or time out, in waves of `wave`
    wave: int
    num_bystanders: int  # greedy streams that run alongside, round after round
    bystander_tokens: int
    num_burst: int  # requests past the admission limit


# A wave and the bystanders stay below PENDING_LIMIT with room to spare: a bystander must never
# meet a 429 that the previous wave's hung-up clients still hold for a moment.
DEFAULT = Scale(num_clients=36, wave=36, num_bystanders=4, bystander_tokens=48, num_burst=24)
LONG_RUN = Scale(num_clients=400, wave=30, num_bystanders=10, bystander_tokens=96, num_burst=300)
SCALES = [pytest.param(DEFAULT, id="default"),
          pytest.param(LONG_RUN, id="long", marks=[
              pytest.mark.chaos_long,
              pytest.mark.skipif(not LONG, reason="the long chaos run: set TANDEM_CHAOS_LONG=1")])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import ray
    from ray import serve

    from tandem.cluster.launcher import start

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process (run this module first or alone)")
    tmp = tmp_path_factory.mktemp("chaos")
    rates = tmp / "rates.json"
    rates.write_text(json.dumps({"cpu": {"prefill_tok_s": 5000.0, "decode_tok_s": 300.0}}))
    handle = start(
        model=MODEL, backends=["cpu", "cpu"], cpu_threads=1, max_active=MAX_ACTIVE,
        max_pending_requests=PENDING_LIMIT, port=free_port(), metrics_port=free_port(),
        routing_log=str(tmp / "routing.jsonl"), rates=str(rates), rates_cache=str(tmp / "rates-cache.json"),
        profile="never", health_check_period_s=0.5, access_log=False, log=lambda line: None,
        calibration_alpha=0, http_replicas=1)  # one ingress: its admission limit is the whole limit
    try:
        yield handle
    finally:
        serve.shutdown()
        handle.shutdown()


# -- clients -----------------------------------------------------------------------------------
def client(tandem) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=tandem.url, timeout=TIMEOUT_S,
                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=50))


def bystander_body(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": f"Bystander {i} tells a long story about the sea.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


@dataclass
class Streamed:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: dict | None = None
    backend: str | None = None
    num_events: int = 0


async def stream(http: httpx.AsyncClient, path: str, body: dict, stop_after: int | None = None,
                 result: Streamed | None = None) -> Streamed:
    """POST a streaming request and read it to [DONE], or hang up after `stop_after` events;
    `result` fills in as the events come."""
    result = result or Streamed()
    async with http.stream("POST", path, json=body) as r:
        result.status, result.backend = r.status_code, r.headers.get("x-tandem-backend")
        if r.status_code != 200:
            await r.aread()
            result.error = r.json().get("error")
            return result
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                result.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                result.num_events += 1
                if "error" in event:
                    result.error = event["error"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    result.text += delta or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if stop_after is not None and result.num_events >= stop_after:
                    return result  # leaving the block closes the connection: the client hung up
    return result


async def bystanders(http: httpx.AsyncClient, scale: Scale) -> list[Streamed]:
    return await asyncio.gather(*(stream(http, COMPLETIONS, bystander_body(i, scale.bystander_tokens))
                                  for i in range(scale.num_bystanders)))


async def chaos_client(http: httpx.AsyncClient, rng: random.Random, backend_may_die: bool = False) -> str:
    """One client that gives up at a random moment; returns what happened to it. A client that
    sees an error from the server (5xx, an error event) fails the test through `outcomes`,
    unless `backend_may_die` and the error is the 503 of a backend that died under it."""
    kind = rng.choice(["before_admission", "after_first_token", "mid_stream", "timeout"])
    path = rng.choice([COMPLETIONS, CHAT])
    body = {"model": MODEL, "max_tokens": rng.randint(8, 200), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randint(0, 2**64 - 1), "ignore_eos": True, "stream": kind != "timeout"}
    text = f"Client {rng.random()} asks about " + "the weather " * rng.randint(1, 40)
    body.update({"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text})
    try:
        if kind == "before_admission":
            task = asyncio.ensure_future(stream(http, path, body))
            await asyncio.sleep(rng.uniform(0.0, 0.03))
            task.cancel()
            result = await task
        elif kind == "timeout":
            r = await http.post(path, json=body, timeout=httpx.Timeout(rng.uniform(0.02, 0.4)))
            result = Streamed(r.status_code, done=r.status_code == 200, error=r.json().get("error"))
        else:
            result = await stream(http, path, body, stop_after=1 if kind == "after_first_token" else rng.randint(2, 12))
    except asyncio.CancelledError:
        return f"{kind}:hung up"
    except httpx.TimeoutException:
        return f"{kind}:timed out"
    if result.status == 429:
        return f"{kind}:429"
    if backend_may_die and (result.error or {}).get("type") == "service_unavailable":
        return f"{kind}:503"
    if result.status != 200 or result.error:
        return f"server error {result.status}: {result.error}"
    return f"{kind}:{'completed' if result.done else 'hung up'}"


# -- the cluster's state -------------------------------------------------------------------------
def instance_ids(tandem) -> dict[str, str]:
    import ray

    backends = tandem.refresh_backends()
    return dict(zip(backends, ray.get([b.ping.remote() for b in backends.values()], timeout=TIMEOUT_S)))


def leftovers(tandem) -> dict:
    """Everything that should be zero once no client is waiting for anything; {} when idle."""
    import ray

    backends = tandem.refresh_backends()
    found = {}
    for backend_id, backend in backends.items():
        stats = ray.get(backend.stats.remote(), timeout=TIMEOUT_S)
        requests = ray.get(backend.num_channel_requests.remote(), timeout=TIMEOUT_S)
        for name, value in (("running", stats.num_running), ("waiting", stats.num_waiting),
                            ("kv_cache_usage", stats.kv_cache_usage), ("core channel requests", requests)):
            if value:
                found[f"{backend_id} {name}"] = value
    for backend_id, summary in ray.get(tandem.router.pending_summary.remote(), timeout=TIMEOUT_S).items():
        if summary["num_active"] or summary["num_queued"]:
            found[f"router ledger {backend_id}"] = summary
    gauges = ray.get(tandem.router.__ray_call__.remote(
        lambda router: {name + str(tags): value for (name, tags), value in router.metrics._gauges.items()
                        if name.startswith("tandem_router_pending_") and value}), timeout=TIMEOUT_S)
    found.update(gauges)
    num_pending = httpx.get(tandem.url + "/health", timeout=TIMEOUT_S).json()["num_pending"]
    if num_pending:
        found["ingress pending"] = num_pending
    return found


def wait_idle(tandem, what: str) -> float:
    """Seconds until the cluster is idle (see `leftovers`)."""
    start = time.monotonic()
    last: dict = {}

    def idle() -> bool:
        nonlocal last
        last = leftovers(tandem)
        return not last

    try:
        wait_for(idle, timeout_s=TIMEOUT_S, interval_s=0.1, what=what)
    except AssertionError:
        raise AssertionError(f"{what}: still busy: {last}") from None
    return time.monotonic() - start


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie has closed its sockets: it counts as gone)."""
    if not os.path.isdir("/proc"):  # macOS: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def report(name: str, **numbers) -> None:
    print(f"CHAOS {json.dumps({'test': name, **numbers})}")


@dataclass
class Bystanders:
    """Rounds of greedy bystander streams, run until `stop` is set, each checked against the
    undisturbed reference."""

    reference: list[Streamed]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    num_intact: int = 0
    broken: list = field(default_factory=list)

    async def run(self, http: httpx.AsyncClient, scale: Scale) -> None:
        while True:
            for i, (got, want) in enumerate(zip(await bystanders(http, scale), self.reference)):
                seen = (got.status, got.text, got.finish_reason, got.done, got.error)
                if seen == (200, want.text, "length", True, None):
                    self.num_intact += 1
                else:
                    self.broken.append((i, got))
            if self.stop.is_set():
                return


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", SCALES)
def test_disconnects_and_timeouts_touch_nobody_else(tiny, scale):
    before = instance_ids(tiny)

    async def scenario():
        async with client(tiny) as http:
            reference = await bystanders(http, scale)
            assert all(r.status == 200 and r.done and r.finish_reason == "length" for r in reference), reference
            watch = Bystanders(reference)
            running = asyncio.ensure_future(watch.run(http, scale))
            rng = random.Random(15)
            outcomes = []
            for start in range(0, scale.num_clients, scale.wave):
                wave = min(scale.wave, scale.num_clients - start)
                outcomes += await asyncio.gather(*(chaos_client(http, rng) for _ in range(wave)))
            watch.stop.set()
            await running
            return reference, watch, outcomes

    started = time.monotonic()
    reference, watch, outcomes = asyncio.run(asyncio.wait_for(scenario(), 20 * TIMEOUT_S))
    elapsed = time.monotonic() - started
    idle_s = wait_idle(tiny, "the cluster to be idle after the disconnects")
    counts = {outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))}
    restarted = [b for b, i in instance_ids(tiny).items() if before.get(b) != i]
    report("disconnects", scale=vars(scale), clients=len(outcomes), outcomes=counts,
           bystanders_intact=watch.num_intact, bystanders_broken=len(watch.broken), backend_restarts=len(restarted),
           seconds=round(elapsed, 1), seconds_to_idle_after=round(idle_s, 2))
    assert not [o for o in outcomes if o.startswith("server error")], counts
    assert sum(n for o, n in counts.items() if o.endswith(("hung up", "timed out"))) >= len(outcomes) // 2, counts
    assert not watch.broken, watch.broken[:3]
    assert watch.num_intact >= scale.num_bystanders
    assert not restarted


@pytest.mark.parametrize("scale", SCALES)
def test_burst_past_the_pending_limit_gets_429_with_retry_after(tiny, scale):
    """The limit's worth of long streams hold every admission slot; each request of a burst then
    gets a 429 at once (or, if a stream finished meanwhile, a full completion), and after the
    streams are gone admission reopens."""
    before = instance_ids(tiny)
    long_body = {"model": MODEL, "prompt": "Hold the line.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    short_body = {"model": MODEL, "prompt": "Burst", "max_tokens": 4}

    async def scenario():
        async with client(tiny) as http:
            requests = [http.build_request("POST", COMPLETIONS, json=long_body) for _ in range(PENDING_LIMIT)]
            held = await asyncio.gather(*(http.send(request, stream=True) for request in requests))
            try:
                assert [r.status_code for r in held] == [200] * PENDING_LIMIT
                burst = await asyncio.gather(*(http.post(COMPLETIONS, json=short_body) for _ in range(scale.num_burst)))
            finally:
                await asyncio.gather(*(r.aclose() for r in held))
            closed = time.monotonic()
            return burst, closed

    burst, closed = asyncio.run(asyncio.wait_for(scenario(), 10 * TIMEOUT_S))
    idle_s = wait_idle(tiny, "the held streams to be freed")
    statuses = [r.status_code for r in burst]
    for r in burst:
        if r.status_code == 429:
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "too_many_pending_requests", error
            assert r.headers["retry-after"] == "1" and error["request_id"] == r.headers["x-tandem-request-id"]
        else:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert statuses.count(429) >= 1
    ok = httpx.post(tiny.url + COMPLETIONS, json=short_body, timeout=TIMEOUT_S)
    assert ok.status_code == 200
    reopened_s = time.monotonic() - closed
    restarted = [b for b, i in instance_ids(tiny).items() if before.get(b) != i]
    report("burst", scale=vars(scale), held=PENDING_LIMIT, burst=len(burst), got_429=statuses.count(429),
           got_200=statuses.count(200), seconds_to_idle_after_hangup=round(idle_s, 2),
           seconds_to_admission_after_hangup=round(reopened_s, 2), backend_restarts=len(restarted))
    assert not restarted


@pytest.mark.parametrize("scale", SCALES)
def test_mixed_burst_loses_nothing(tiny, scale):
    """At least twice the limit of short greedy requests at once on an idle cluster: the first
    PENDING_LIMIT to arrive are all admitted, so at least that many complete; each is the full
    completion, the same text as the request sent alone, or a 429 with Retry-After; never
    anything else, and nothing is left behind."""
    body = {"model": MODEL, "prompt": "Quick one", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    num_requests = max(2 * PENDING_LIMIT, scale.num_burst)
    alone = httpx.post(tiny.url + COMPLETIONS, json=body, timeout=TIMEOUT_S)
    assert alone.status_code == 200, alone.text
    want = alone.json()["choices"][0]["text"]
    wait_idle(tiny, "the cluster to be idle before the burst")  # every admission slot is free

    async def scenario():
        async with client(tiny) as http:
            return await asyncio.gather(*(http.post(COMPLETIONS, json=body) for _ in range(num_requests)))

    responses = asyncio.run(asyncio.wait_for(scenario(), 10 * TIMEOUT_S))
    for r in responses:
        assert r.status_code in (200, 429), r.text
        if r.status_code == 200:
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            assert (choice["text"], choice["finish_reason"], usage["completion_tokens"]) == (want, "length", 8), r.text
        else:
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "too_many_pending_requests", error
            assert r.headers["retry-after"] == "1" and error["request_id"] == r.headers["x-tandem-request-id"]
    got_200 = sum(r.status_code == 200 for r in responses)
    wait_idle(tiny, "the cluster to be idle after the burst")
    report("mixed burst", requests=len(responses), got_200=got_200, got_429=len(responses) - got_200)
    assert got_200 >= PENDING_LIMIT, f"only {got_200} of {len(responses)} completed; the limit admits {PENDING_LIMIT}"


def test_backend_killed_mid_stream(tiny):
    """Streams on the killed backend end with a 503 error event (or, before their first token,
    fail over and complete); streams on the other backend complete byte-identical to an
    undisturbed run; clients that hang up while it all happens (during fail-over, too) leave
    nothing behind; the killed backend rejoins with a new instance id, the other never restarts."""
    import ray

    victim, survivor = sorted(tiny.refresh_backends())
    before = instance_ids(tiny)
    scale = Scale(num_clients=0, wave=1, num_bystanders=8, bystander_tokens=600, num_burst=0)
    timings = {}

    async def scenario():
        async with client(tiny) as http:
            reference = await bystanders(http, scale)
            results = [Streamed() for _ in range(scale.num_bystanders)]
            tasks = [asyncio.ensure_future(stream(http, COMPLETIONS, bystander_body(i, scale.bystander_tokens),
                                                  result=results[i])) for i in range(scale.num_bystanders)]
            deadline = time.monotonic() + TIMEOUT_S
            while not any(r.backend == victim and r.num_events > 0 for r in results):
                assert time.monotonic() < deadline, f"no stream was routed to {victim}: {results}"
                await asyncio.sleep(0.005)
            rng = random.Random(16)
            hanging_up = asyncio.gather(*(chaos_client(http, rng, backend_may_die=True) for _ in range(16)))
            await asyncio.sleep(0.01)
            timings["killed"] = time.monotonic()
            ray.kill(tiny.backends[victim], no_restart=False)  # a crash: Ray restarts it
            while victim in await tiny.router.backend_infos.remote():
                await asyncio.sleep(0.01)
            timings["dropped"] = time.monotonic()
            return reference, await asyncio.gather(*tasks), await hanging_up

    reference, results, outcomes = asyncio.run(asyncio.wait_for(scenario(), 10 * TIMEOUT_S))
    assert not [o for o in outcomes if o.startswith("server error")], outcomes

    def rejoined() -> bool:
        infos = ray.get(tiny.router.backend_infos.remote(), timeout=TIMEOUT_S)
        return victim in infos and infos[victim].instance_id != before[victim]

    wait_for(rejoined, timeout_s=120, interval_s=0.1, what=f"{victim} to rejoin")
    rejoined_s = time.monotonic() - timings["killed"]
    cut = [r for r in results if r.error]
    for got, want in zip(results, reference):
        if got.error:
            assert got.backend == victim and got.error["type"] == "service_unavailable" and got.done, got
            assert want.text.startswith(got.text), "a cut stream's text must be a prefix of the undisturbed one"
        else:
            assert (got.status, got.text, got.finish_reason, got.done) == (200, want.text, "length", True), got
    assert cut, "the kill should have cut a stream that was running on the victim"
    assert all(r.error is None for r in results if r.backend == survivor)
    after = instance_ids(tiny)
    assert after[survivor] == before[survivor] and after[victim] != before[victim]
    with httpx.Client(base_url=tiny.url, timeout=TIMEOUT_S) as http:
        served = {http.post(COMPLETIONS, json={"model": MODEL, "prompt": f"After {i}", "max_tokens": 4})
                  .headers["x-tandem-backend"] for i in range(6)}
    assert victim in served
    idle_s = wait_idle(tiny, "the cluster to be idle after the kill")
    report("kill", streams=len(results), cut=len(cut), completed=len(results) - len(cut),
           clients_hanging_up={o: outcomes.count(o) for o in sorted(set(outcomes))},
           seconds_to_drop=round(timings["dropped"] - timings["killed"], 2), seconds_to_rejoin=round(rejoined_s, 2),
           seconds_to_idle_after=round(idle_s, 2),
           backend_restarts_besides_victim=int(after[survivor] != before[survivor]))


def test_ingress_replica_killed_serves_again_on_the_same_port(tiny):
    """With direct ingress (the default here) the Serve replica itself listens on the API port:
    killed, Serve starts a new one, which takes the same port back, and nothing else restarts.
    Until the new one can serve the port refuses connections; it never answers with anything
    but the completion (the new replica listens only once Serve has initialised it)."""
    import ray

    assert tiny.config.ingress == "direct"
    before = instance_ids(tiny)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and "TandemIngress" in a["name"]]
    assert len(replicas) == 1, replicas
    ray.kill(ray.get_actor(replicas[0]["name"], namespace="serve"), no_restart=True)
    body = {"model": MODEL, "prompt": "Back again?", "max_tokens": 4}
    statuses: list[int] = []

    def answers() -> bool:
        try:
            statuses.append(httpx.post(tiny.url + COMPLETIONS, json=body, timeout=5.0).status_code)
        except httpx.HTTPError:  # refused (nobody listens yet) or reset by the dying replica
            return False
        return statuses[-1] == 200

    wait_for(answers, timeout_s=120, interval_s=0.1, what="a new ingress replica on the same port")
    assert set(statuses) == {200}, statuses
    assert instance_ids(tiny) == before
    wait_idle(tiny, "the cluster to be idle after the ingress restart")


def test_a_dead_router_is_a_503_not_a_500(tiny):
    """Last in this module: it leaves the cluster without its router (nothing restarts one)."""
    import ray

    # ray.kill is asynchronous, and Ray declares the actor dead before its process has exited:
    # until then the router's same-node wire still answers, so wait for the process to be gone.
    pid = ray.get(tiny.router.__ray_call__.remote(lambda router: os.getpid()))
    ray.kill(tiny.router, no_restart=True)
    deadline = time.monotonic() + TIMEOUT_S
    while _alive(pid):
        assert time.monotonic() < deadline, "the killed router's process is still running"
        time.sleep(0.05)
    with httpx.Client(base_url=tiny.url, timeout=TIMEOUT_S) as http:
        r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "Anyone there?", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        assert http.get("/health").status_code == 503
