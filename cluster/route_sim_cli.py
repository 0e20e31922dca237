"""`tandem route-sim`: routing's what-if simulator (routing/sim_cli.py), on the engine's own
scheduler and KV cache, which only this layer can offer.

A scenario with prefix caches (tenants, or a replayed routing log with block hashes) runs each
backend on the engine's `Scheduler` and `KVCacheManager` in virtual time
(cluster/engine_sim_backend.py): chunked prefill, mixed steps, the block pool's LRU and its
eviction order, host KV tiers included. That is the code the `sim` device runs in real time
behind the real server, so a fidelity measurement of one checks the other. A scenario of fixed
hits per request (the design's experiment) has no cache to model and runs on route-sim's own
backends. `--fast-backends` runs every scenario on route-sim's own backends and their
approximate prefix cache (routing/sim_prefix_cache.py): faster, for wide sweeps, and less
faithful under cache pressure (docs/routing.md compares the two).
"""

from __future__ import annotations

import argparse

from tandem.routing import sim_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sim_cli.add_arguments(parser)
    parser.add_argument("--fast-backends", action="store_true",
                        help="simulate on route-sim's own prefill-first backends and approximate prefix cache "
                             "instead of the engine's scheduler and KV cache: faster for wide sweeps, less "
                             "faithful under cache pressure, no host KV tier")
    parser.add_argument("--engine-scheduler", action="store_true", help=argparse.SUPPRESS)  # older commands name the default
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="tokens per engine step on every backend (default: the scenario's per backend, "
                             "else the engine's for its device kind: 512 on cpu, 8192 on cuda and sim)")


def run(args: argparse.Namespace) -> int:
    factory = None
    if not args.fast_backends:
        from tandem.cluster.engine_sim_backend import engine_backend_factory

        factory = engine_backend_factory(args.max_num_batched_tokens)
    return sim_cli.run(args, factory)
