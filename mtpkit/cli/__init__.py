"""`mtpkit` command line: one module per subcommand, each with `add_parser(subparsers)` and `run(args)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import MtpkitError

# subcommand -> module under mtpkit.cli; each keeps its heavy imports inside run()
COMMANDS = {
    "inspect": "inspect_cmd",
    "generate": "generate_cmd",
    "train": "train_cmd",
    "export": "export_cmd",
    "graft": "graft_cmd",
    "refresh": "refresh_cmd",
    "plot": "plot_cmd",
    "distill": "distill_cmd",
    "features": "features_cmd",
    "bench": "bench_cmd",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpkit", description="Multi-token prediction: train, decode, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {name: importlib.import_module(f"mtpkit.cli.{mod}") for name, mod in COMMANDS.items()}
    for name, module in modules.items():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return modules[args.command].run(args) or 0
    except (MtpkitError, ValueError, OSError) as e:  # bad input or a file problem: one clear line, no traceback
        print(f"mtpkit {args.command}: error: {e}", file=sys.stderr)
        return 2
