"""The `deployrl` command line."""

from __future__ import annotations

import argparse
import sys

from deployrl import __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="deployrl",
        description="RL post-training of language models against the engine you deploy.",
    )
    parser.add_argument("--version", action="version", version=f"deployrl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    commands.add_parser("train", add_help=False, help="RL post-training (no arguments: the embedded default)")
    commands.add_parser("eval", add_help=False, help="score a model on a task or benchmark in a deployment engine")
    commands.add_parser(
        "selfcheck",
        add_help=False,
        help="variance of the prefix-sampled gradient per cutoff strategy on a random instance",
    )
    commands.add_parser(
        "mismatch",
        add_help=False,
        help="sample with a deployment engine, recompute with the trainer, report the discrepancy",
    )
    commands.add_parser("bench", add_help=False, help="benchmarks: update-phase speed/memory, gradient variance, whole steps")
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        from deployrl.train_cli import main as command
    elif args.command == "eval":
        from deployrl.evaluate import main as command
    elif args.command == "bench":
        from deployrl.bench import main as command
    elif args.command == "selfcheck":
        from deployrl.selfcheck import main as command
    else:
        from deployrl.mismatch import main as command
    return command(rest)


if __name__ == "__main__":
    raise SystemExit(main())
