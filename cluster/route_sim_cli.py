"""`tandem route-sim`: routing's what-if simulator (routing/sim_cli.py), with one more choice of
backend model that only this layer can offer.

`--engine-scheduler` simulates each backend on the engine's own scheduler and KV cache in
virtual time (cluster/engine_sim_backend.py), the model the `sim` device runs in real time,
instead of route-sim's own prefill-first scheduler: slower, and closer to a live server where
chunked prefill, mixed steps and the block pool's eviction decide TTFT and hit rate.
"""

from __future__ import annotations

import argparse

from tandem.routing import sim_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sim_cli.add_arguments(parser)
    parser.add_argument("--engine-scheduler", action="store_true",
                        help="simulate backends on the engine's scheduler and KV cache, host KV tiers included "
                             "(closer to a live server, slower); the oracle keeps route-sim's own backends")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                        help="with --engine-scheduler: tokens per engine step (default 8192, cuda's)")


def run(args: argparse.Namespace) -> int:
    factory = None
    if args.engine_scheduler:
        from tandem.cluster.engine_sim_backend import engine_backend_factory

        factory = engine_backend_factory(args.max_num_batched_tokens)
    return sim_cli.run(args, factory)
