"""The `tandem` command line.

Each subcommand lives in the module that owns its concern and exposes two functions,
`add_arguments(parser)` and `run(args) -> int`. This file only wires them together and
imports a subcommand's module lazily, so `tandem route-sim` never pays for importing torch
and `tandem --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tandem.engine.cli", "run one request in-process and print the completion"),
    "route-sim": ("tandem.cluster.route_sim_cli", "replay a routing scenario through the what-if simulator"),
    "serve": ("tandem.cluster.serve_cli", "start the cluster and its OpenAI-compatible HTTP API"),
    "profile": ("tandem.cluster.profile_cli", "measure each backend's rates alone and write the router's rates file"),
    "bench": ("bench.cli", "the benchmarks: end to end through HTTP (seed, sweep, tenants, soak), and of the engine, "
                           "the serving path and the router"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    _ray_env_defaults()
    return int(import_subcommand(args._module).run(args) or 0)


def import_subcommand(module_name: str):
    """The subcommand's module. `bench` is not installed with Tandem: it is found in the source
    checkout this `tandem` package lives in (an editable install), else the user is told. This is
    the product's one import of bench, allowed by name in tests/test_layering.py's EXCEPTIONS."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != "bench":
            raise
    checkout = Path(__file__).resolve().parents[1]  # cluster/cli.py in a checkout; tandem/cluster/ installed
    if not (checkout / "bench" / "__init__.py").is_file():
        raise SystemExit("error: `tandem bench` runs from a source checkout (pip install -e .): the benchmark "
                         "suite is not part of the installed package")
    sys.path.insert(0, str(checkout))
    return importlib.import_module(module_name)


def _ray_env_defaults() -> None:
    """Set before any subcommand imports Ray (see `launcher.ray_env_defaults`)."""
    from tandem.cluster.launcher import ray_env_defaults

    ray_env_defaults()


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: one machine, a CPU engine and an accelerator engine serving "
        "together, each request routed to the backend that finishes it soonest.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        if name == chosen:
            import_subcommand(module_name).add_arguments(sub_parser)
    return parser


if __name__ == "__main__":
    sys.exit(main())
