"""Benchmark workloads: which prompts arrive when, and what each backend's cache is seeded with.

The benches' request shapes live here (bench/tenants.py adds the multi-tenant one, bench/soak_traffic.py
the soak's kinds of request), drawn from a seeded RNG so every arm and run of a cell sees the
same requests. Prompts are token ids, so lengths and shared prefixes are exact whatever the
tokenizer; ids 32..126 are printable ASCII in the random presets' byte tokenizer and ordinary
SmolLM2 tokens. `spec_workload` is the design's experiment (identical 516-token prompts, caches
seeded with the first 508: 31 reusable 16-token blocks); `sweep_workload` a seeded prefix of a
target cache-hit rate in whole blocks plus a suffix per request; `varied_requests` lengths
uniform in ranges (workload W: 512 requests, 64-2,048 prompt and 32-1,024 output tokens);
`nanovllm_requests` nano-vllm's benchmark; `priority_mix` urgent requests among batch work.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

TOKEN_ID_LOW, TOKEN_ID_HIGH = 32, 127  # [low, high): printable ASCII bytes / common tokens


@dataclass
class WorkloadRequest:
    index: int
    arrival_s: float  # offset from the run's start at which the client sends it
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: int | None = None  # multi-tenant workloads (bench/tenants.py): whose shared prefix it carries


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    seed_prompts: list[list[int]]  # sent once to every backend before the measurement
    num_shared_prefix_tokens: int  # prompt tokens every request shares with the seed prompt
    block_size: int = 16
    description: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def expected_cached_tokens(self) -> int:
        """Reusable prefix per request after seeding: the shared prefix in whole blocks."""
        return (self.num_shared_prefix_tokens // self.block_size) * self.block_size

    def summary(self) -> dict[str, Any]:
        """JSON-able description without the token ids (those are reproducible from the seed)."""
        first = self.requests[0] if self.requests else None
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "arrivals_s": [round(r.arrival_s, 6) for r in self.requests],
            "num_prompt_tokens": len(first.prompt_token_ids) if first else 0,
            "max_tokens": first.max_tokens if first else 0,
            "num_shared_prefix_tokens": self.num_shared_prefix_tokens,
            "expected_cached_tokens": self.expected_cached_tokens,
            "num_seed_prompt_tokens": [len(p) for p in self.seed_prompts],
            **self.description,
        }


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n)]


def fixed_arrivals(num_requests: int, interval_s: float) -> list[float]:
    return [i * interval_s for i in range(num_requests)]


def poisson_arrivals(num_requests: int, rate_per_s: float, rng: random.Random) -> list[float]:
    """A Poisson process starting at 0: the first request at 0, then exponential gaps."""
    if rate_per_s <= 0:
        raise ValueError(f"arrival rate must be > 0 requests/s (got {rate_per_s})")
    arrivals, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate_per_s)
        arrivals.append(t)
    return arrivals


def spec_workload(num_requests: int, prompt_tokens: int = 516, seed_prefix_tokens: int = 508,
                  max_tokens: int = 128, interval_s: float = 0.05, token_seed: int = 0,
                  block_size: int = 16, name: str | None = None) -> Workload:
    """The design's setting: N identical prompts every `interval_s`, caches seeded with a prefix."""
    if not 0 < seed_prefix_tokens <= prompt_tokens:
        raise ValueError(f"seed prefix ({seed_prefix_tokens}) must be in 1..prompt tokens ({prompt_tokens})")
    rng = random.Random(token_seed)
    prompt = random_tokens(rng, prompt_tokens)
    requests = [WorkloadRequest(i, t, list(prompt), max_tokens)
                for i, t in enumerate(fixed_arrivals(num_requests, interval_s))]
    return Workload(
        name=name or f"spec-n{num_requests}", requests=requests, seed_prompts=[prompt[:seed_prefix_tokens]],
        num_shared_prefix_tokens=seed_prefix_tokens, block_size=block_size,
        description={"kind": "spec", "arrival": "fixed", "interval_s": interval_s, "identical_prompts": True,
                     "token_seed": token_seed})


def sweep_workload(num_requests: int, prompt_tokens: int, max_tokens: int, cache_hit: float,
                   arrivals_s: list[float], token_seed: int = 0, block_size: int = 16,
                   name: str = "cell", description: dict[str, Any] | None = None) -> Workload:
    """A seeded shared prefix of `cache_hit` of the prompt (whole blocks), a unique suffix each."""
    if not 0 <= cache_hit < 1:
        raise ValueError(f"cache_hit must be in [0, 1) (got {cache_hit})")
    if len(arrivals_s) != num_requests:
        raise ValueError(f"{len(arrivals_s)} arrival times for {num_requests} requests")
    rng = random.Random(token_seed)
    num_shared = round(cache_hit * prompt_tokens / block_size) * block_size  # the nearest whole block
    num_shared = min(num_shared, (prompt_tokens - 1) // block_size * block_size)  # a suffix of its own stays
    prefix = random_tokens(rng, num_shared)
    requests = [WorkloadRequest(i, t, prefix + random_tokens(rng, prompt_tokens - num_shared), max_tokens)
                for i, t in enumerate(arrivals_s)]
    return Workload(
        name=name, requests=requests, seed_prompts=[prefix] if num_shared else [],
        num_shared_prefix_tokens=num_shared, block_size=block_size,
        description={"kind": "sweep", "cache_hit_target": cache_hit, "identical_prompts": False,
                     "token_seed": token_seed, **(description or {})})


@dataclass(frozen=True)
class CellSpec:
    """One benchmark cell: the cluster setting (accelerator max_active) and the workload's parameters.

    `kind="spec"` is the design's experiment (identical prompts, caches seeded with the prompt's
    first `seed_prefix_tokens`); `kind="sweep"` is `sweep_workload` (a seeded shared prefix of
    `cache_hit` of the prompt, a unique suffix per request).
    """

    num_requests: int
    prompt_tokens: int = 516
    max_tokens: int = 128
    cache_hit: float = 0.96
    arrival: str = "fixed"  # fixed | poisson
    interval_s: float = 0.05  # fixed arrivals
    rate_per_s: float = 0.0  # poisson arrivals
    accel_max_active: int = 4
    kind: str = "sweep"  # sweep | spec
    seed_prefix_tokens: int = 508  # spec cells only

    @property
    def name(self) -> str:
        if self.kind == "spec":
            return f"n{self.num_requests}"
        arrival = f"every{self.interval_s * 1000:g}ms" if self.arrival == "fixed" else f"poisson{self.rate_per_s:g}"
        return (f"n{self.num_requests}-ma{self.accel_max_active}-{arrival}-hit{round(self.cache_hit * 100)}"
                f"-p{self.prompt_tokens}-o{self.max_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}

    def workload(self, token_seed: int, block_size: int = 16, arrival_seed: int | None = None) -> Workload:
        """The cell's requests; Poisson arrival times come from `arrival_seed` (default:
        `token_seed`), so arms can share arrival times while their prompts differ."""
        if self.kind == "spec":
            return spec_workload(self.num_requests, self.prompt_tokens, self.seed_prefix_tokens, self.max_tokens,
                                 self.interval_s, token_seed, block_size, self.name)
        if self.arrival == "fixed":
            arrivals = fixed_arrivals(self.num_requests, self.interval_s)
        elif self.arrival == "poisson":
            seed = token_seed if arrival_seed is None else arrival_seed
            arrivals = poisson_arrivals(self.num_requests, self.rate_per_s, random.Random(seed + 7919))
        else:
            raise ValueError(f"unknown arrival process {self.arrival!r}; use fixed or poisson")
        return sweep_workload(self.num_requests, self.prompt_tokens, self.max_tokens, self.cache_hit, arrivals,
                              token_seed, block_size, self.name,
                              {"arrival": self.arrival, "interval_s": self.interval_s, "rate_per_s": self.rate_per_s})


def random_prompts(num: int, length: int, seed: int, low: int = 3, high: int = 250) -> list[list[int]]:
    """`num` prompts of `length` random ids in [low, high): no two share a prefix."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(num)]


def shared_prefix_prompts(num: int, length: int, prefix: int, seed: int, low: int = 3,
                          high: int = 250) -> list[list[int]]:
    """`num` prompts of `length` ids whose first `prefix` are the same, the rest each its own."""
    rng = random.Random(seed)
    shared = [rng.randrange(low, high) for _ in range(prefix)]
    return [shared + [rng.randrange(low, high) for _ in range(length - prefix)] for _ in range(num)]


W = (512, (64, 2048), (32, 1024))  # workload W: requests, prompt and output length ranges


def varied_requests(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                    scale: float = 1.0, max_model_len: int | None = None, low: int = 3,
                    high: int = 250) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request: lengths uniform in the ranges times `scale`, capped so
    prompt + output fits `max_model_len`."""
    rng = random.Random(seed)
    ids = range(low, high)
    requests = []
    for _ in range(num):
        num_prompt = rng.randint(int(prompt_range[0] * scale), int(prompt_range[1] * scale))
        num_output = rng.randint(int(output_range[0] * scale), int(output_range[1] * scale))
        if max_model_len is not None:
            num_prompt = min(num_prompt, max_model_len - 1)
            num_output = min(num_output, max_model_len - num_prompt)
        requests.append((rng.choices(ids, k=num_prompt), num_output))
    return requests


def nanovllm_requests(num: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's bench.py: prompt lengths, then output lengths, each uniform in [100, 1024]."""
    rng = random.Random(seed)
    prompts = [rng.choices(range(3, 250), k=rng.randint(100, 1024)) for _ in range(num)]
    return [(prompt, rng.randint(100, 1024)) for prompt in prompts]


@dataclass(frozen=True)
class Traffic:
    """Urgent requests (short, priority 0, a TTFT deadline) mixed among batch work (priority 1)."""

    urgent_share: float = 0.2
    deadline_ms: float = 500.0
    urgent_prompt_tokens: int = 64
    urgent_max_tokens: int = 16
    batch_prompt_tokens: int = 256
    batch_max_tokens: int = 128


@dataclass
class PriorityRequest:
    index: int
    arrival_s: float
    urgent: bool
    prompt: list[int]
    max_tokens: int


def priority_mix(rate_per_s: float, duration_s: float, traffic: Traffic, seed: int,
                 prompts_of: str = "") -> list[PriorityRequest]:
    """Poisson arrivals over `duration_s`; each request urgent with probability `urgent_share`.

    Arrivals and classes come from `seed` alone, so every arm sees the same traffic; the prompts'
    tokens also from the rate and `prompts_of` (the arm), because arms and rates run one after
    another on one cluster and a prompt seen before would be a prefix-cache hit for the later one."""
    rng = random.Random(seed)
    tokens = random.Random(f"{seed}/{rate_per_s}/{prompts_of}")
    requests, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        urgent = rng.random() < traffic.urgent_share
        num_prompt = traffic.urgent_prompt_tokens if urgent else traffic.batch_prompt_tokens
        prompt = [tokens.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(num_prompt)]
        max_tokens = traffic.urgent_max_tokens if urgent else traffic.batch_max_tokens
        requests.append(PriorityRequest(len(requests), t, urgent, prompt, max_tokens))
        t += rng.expovariate(rate_per_s)
    return requests
