"""`python -m bench.soak_engine`: the soak's traffic mix driven straight into one `LLMEngine`, in
this process, without Ray or HTTP: does the engine's memory grow with the requests it serves?

bench/soak.py measures a whole server; when a process of it grows, this separates the engine's
share from everything around it. Each of `--clients` clients draws its requests from
bench/soak_traffic.py's `Planner` (same kinds, weights and seeds) and each request becomes what
the HTTP ingress would hand the engine: completions as token ids, chat messages through the
chat template, `response_format` and forced tool calls as their grammar (cluster/tools.py's
`plan_output`), `n` as is. A hang-up aborts its request after the events the client would read
(0: right after the add). Malformed requests that the ingress refuses never reach the engine
(counted as refused); the over-long prompt is added and refused by the engine. One in five
requests also gets stop strings. As the engine core does, progress and cache changes are
drained after every step.

Every `--every` finished requests it prints the process's RSS (after `gc.collect()`) and the
size of each per-request map of the engine, which must stay at the handful of requests in
flight. `--tracemalloc N` starts tracing at request N and prints the top growth by traceback
between the next report and the end (Python allocations only: a growing RSS with a flat trace
is native memory). `--kinds a,b` draws only those kinds, evenly. Example (the measurement in
docs/benchmarks/soak-2core.notes.md):

    python -m bench.soak_engine --requests 8000 --every 1000
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from typing import Any

from bench.soak_traffic import Planned, Planner

STOP_STRINGS = ["e", "ab"]
STOP_SHARE = 0.2


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def engine_request(engine: Any, planned: Planned, rng: random.Random) -> tuple[list[int], Any, int | None] | None:
    """(prompt ids, SamplingParams, events before a hang-up or None), or None for a request the
    ingress refuses before it reaches an engine."""
    from tandem.cluster.protocol import ChatCompletionRequest
    from tandem.cluster.tools import plan_output
    from tandem.engine.sampling_params import SamplingParams

    body = planned.body
    if planned.kind == "malformed":
        too_long = isinstance(body, dict) and len(body.get("prompt", [])) > engine.max_model_len
        return (body["prompt"], SamplingParams(max_tokens=body["max_tokens"]), None) if too_long else None
    kwargs = dict(max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0), seed=body.get("seed"),
                  n=body.get("n", 1), ignore_eos=body.get("ignore_eos", False))
    if rng.random() < STOP_SHARE:
        kwargs["stop"] = list(STOP_STRINGS)
    if "messages" in body:
        request = ChatCompletionRequest(**body)
        kwargs["structured_output"] = plan_output(request, getattr(engine.tokenizer, "chat_template", None)
                                                  ).structured_output
        prompt = engine.apply_chat_template(request.template_messages())
    else:
        prompt = body["prompt"]
    hang_up_after = planned.hang_up_after if planned.kind == "hang_up" else None
    return prompt, SamplingParams(**kwargs), hang_up_after


def per_request_maps(engine: Any) -> dict[str, int]:
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    groups = engine.request_groups
    return {"tracked": len(engine.output_processor.tracked), "changed": len(engine.reporter.changed),
            "groups": len(groups.groups), "child_of": len(groups.child_of), "scheduler": len(scheduler.requests),
            "kv_req_to_blocks": len(kv.req_to_blocks), "kv_req_to_cached": len(kv.req_to_num_cached_blocks),
            "cached_blocks": len(kv.block_pool.cached_blocks)}


class Driver:
    """The clients, back to back, on one engine."""

    def __init__(self, engine: Any, clients: int, max_tokens: int, kinds: list[str]) -> None:
        self.engine = engine
        self.planners = [Planner(engine.model_name, engine.max_model_len, max_tokens, seed=i) for i in range(clients)]
        if kinds:
            for planner in self.planners:
                planner.next = (lambda p=planner: getattr(p, "_" + p.rng.choice(kinds))())
        self.rng = random.Random(0)
        self.idle = list(range(clients))
        self.live: dict[str, list] = {}  # req_id -> [events before a hang-up or None, outputs read, client]
        self.counts = {"sent": 0, "done": 0, "refused": 0, "aborted": 0}

    def fill(self) -> None:
        from tandem.engine.sampling_params import InvalidRequestError

        while self.idle:
            client = self.idle.pop()
            planned = self.planners[client].next()
            self.counts["sent"] += 1
            req_id = f"req-{self.counts['sent']}"
            request = engine_request(self.engine, planned, self.rng)
            try:
                if request is None:
                    raise InvalidRequestError("refused by the ingress")
                self.engine.add_request(req_id, request[0], request[1])
            except InvalidRequestError:
                self._end(client, "refused")
                continue
            self.live[req_id] = [request[2], 0, client]
            if request[2] == 0:
                self.engine.abort_request(req_id)
                self.counts["aborted"] += 1

    def step(self) -> None:
        for out in self.engine.step():
            state = self.live.get(out.req_id)
            if state is None:
                continue
            state[1] += 1
            if out.finished:
                del self.live[out.req_id]
                self._end(state[2])
            elif state[0] is not None and state[1] >= state[0]:
                self.engine.abort_request(out.req_id)
                self.counts["aborted"] += 1
        self.engine.drain_progress()
        self.engine.drain_cache_changes()

    def _end(self, client: int, outcome: str | None = None) -> None:
        self.idle.append(client)
        self.counts["done"] += 1
        if outcome:
            self.counts[outcome] += 1


def print_growth(before: tracemalloc.Snapshot, top: int = 10) -> None:
    after = tracemalloc.take_snapshot()
    print(f"tracemalloc: {tracemalloc.get_traced_memory()[0] / 2**20:.2f} MiB traced now; top growth:")
    for stat in after.compare_to(before, "traceback")[:top]:
        print(f"  {stat}")
        for line in stat.traceback.format()[-6:]:
            print(f"    {line}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-random")
    parser.add_argument("--requests", type=int, default=8000, help="finished requests to run (default 8000)")
    parser.add_argument("--every", type=int, default=1000, help="report every this many (default 1000)")
    parser.add_argument("--clients", type=int, default=8, help="requests in flight (default 8, the soak's)")
    parser.add_argument("--max-active", type=int, default=4, help="the engine's (default 4, a CPU backend's)")
    parser.add_argument("--max-tokens", type=int, default=32, help="most output tokens a request asks (default 32)")
    parser.add_argument("--kinds", default="", help="draw only these kinds of bench/soak_traffic.py, comma-separated")
    parser.add_argument("--tracemalloc", type=int, default=0, help="trace Python allocations from this request on")
    args = parser.parse_args(argv)

    from tandem.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=args.model, device="cpu", max_active=args.max_active, num_threads=1)
    driver = Driver(engine, args.clients, args.max_tokens, [k for k in args.kinds.split(",") if k])
    print(f"{args.model}: context {engine.max_model_len}, RSS {rss_mib():.1f} MiB after loading", flush=True)
    start, next_report, snapshot = time.perf_counter(), args.every, None
    while driver.counts["done"] < args.requests:
        driver.fill()
        driver.step()
        if driver.counts["done"] < next_report:
            continue
        next_report += args.every
        gc.collect()
        counts = " ".join(f"{k} {v}" for k, v in driver.counts.items())
        print(f"{counts} | {time.perf_counter() - start:.0f} s | RSS {rss_mib():.1f} MiB | "
              f"{per_request_maps(engine)}", flush=True)
        if args.tracemalloc and driver.counts["done"] >= args.tracemalloc:
            if not tracemalloc.is_tracing():
                tracemalloc.start(12)
            elif snapshot is None:
                snapshot = tracemalloc.take_snapshot()
    if snapshot is not None:
        gc.collect()
        print_growth(snapshot)


if __name__ == "__main__":
    main()
