"""`deployrl bench`: speed, memory and estimator-quality benchmarks, printed side by side.

    deployrl bench update     update-phase time and peak memory per method and completion length
    deployrl bench variance   gradient variance and cosine to the full gradient per cutoff strategy
    deployrl bench step       whole training steps of deployrl (and TRL's GRPOTrainer with --vs trl)
    deployrl bench engines    llama.cpp tokens/s, one completion at a time against batched decoding
    deployrl bench vs-trl     deployrl against TRL at equal wall time, scored in the deployed engine

Benchmarks print tables of ratios measured in one run; they are never timed tests.
"""

from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "update": ("deployrl.commands.bench.update", "update-phase wall time and peak memory: full GRPO, DAPO, S-GRPO, PS-PPO"),
    "variance": ("deployrl.commands.bench.variance", "gradient variance and cosine similarity per cutoff strategy and budget"),
    "step": ("deployrl.commands.bench.step", "seconds and peak memory per training step, optionally against TRL"),
    "engines": ("deployrl.commands.bench.engines", "llama.cpp tokens/s: one completion at a time vs batched, per K and length"),
    "vs-trl": ("deployrl.commands.bench.vs_trl", "deployrl vs TRL at equal wall time, scored in the deployed engine"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deployrl bench", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="benchmark", required=True)
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, add_help=False, help=help_text)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(rest)
