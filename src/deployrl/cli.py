"""The `deployrl` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from deployrl import __version__

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS = {
    "train": ("deployrl.commands.train", "RL post-training (no arguments: the embedded default)"),
    "eval": ("deployrl.commands.evaluate", "score a model on a task or benchmark in a deployment engine"),
    "selfcheck": ("deployrl.commands.selfcheck",
                  "variance of the prefix-sampled gradient per cutoff strategy on a random instance"),
    "mismatch": ("deployrl.commands.mismatch",
                 "sample with a deployment engine, recompute with the trainer, report the discrepancy"),
    "engines": ("deployrl.commands.engines", "what each engine will do on this machine, measured per CPU class"),
    "bench": ("deployrl.commands.bench", "benchmarks: update-phase speed/memory, gradient variance, whole steps, engines"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="deployrl",
        description="RL post-training of language models against the engine you deploy.",
    )
    parser.add_argument("--version", action="version", version=f"deployrl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, add_help=False, help=help_text)
    args, rest = parser.parse_known_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
