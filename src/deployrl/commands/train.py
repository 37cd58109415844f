"""`deployrl train`: a YAML config plus dotted overrides, or the embedded default."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from deployrl.settings.command_line import CommandLine
    from deployrl.settings.config import TrainConfig

    command_line = CommandLine(
        "deployrl train", TrainConfig,
        "RL post-training against the deployment engine. With no arguments: the embedded default"
        " (SmolLM2-135M-Instruct, reasoning-gym arithmetic, LoRA adapters trained in fp32 on the frozen"
        " base, llama.cpp Q4_1 sampling with the adapter applied, DC-GRPO + PS-PPO). Overrides are section.key=value, e.g. algo.dc.tolerance=0.01.",
        epilog=(
            "Several processes (FSDP2; gloo on CPU, NCCL on GPUs): torchrun --nproc_per_node=N -m deployrl train"
            " [config.yaml] [key=value ...]; several nodes: add torchrun's --nnodes and --rdzv-endpoint."
            " See docs/distributed.md."
        ),
    )
    command_line.parser.add_argument("--resume", action="store_true",
                                     help="continue from the run directory's latest checkpoint")
    command_line.parser.add_argument("--export", default=None, metavar="DIR",
                                     help="after training, write the final model to DIR: an HF folder and a GGUF (merged),"
                                          " and with LoRA the peft adapter and a llama.cpp GGUF adapter")
    config, args = command_line.parse(argv)

    from deployrl.errors import TrainingError, TrainingInterrupted
    from deployrl.models.loading import UnsupportedModelError
    from deployrl.tasks import TaskDataError
    from deployrl.training.checkpoint import CheckpointError, latest_checkpoint
    from deployrl.training.distributed import close_world
    from deployrl.training.runlog import RunDirectoryError
    from deployrl.training.trainer import Trainer

    resume_command = shlex.join(
        ["deployrl", "train", *args.items, *(["--export", args.export] if args.export else []), "--resume"]
    )
    try:
        trainer = Trainer(config, resume=args.resume)
    except (RunDirectoryError, CheckpointError, TaskDataError, UnsupportedModelError, FileNotFoundError) as err:
        print(f"deployrl train: error: {err}", file=sys.stderr)  # bad input: its message, not a traceback
        return 1
    trainer.resume_command = resume_command
    if trainer.resumed_from is not None:
        print(f"resuming from {trainer.resumed_from} (step {trainer.state.step})", file=sys.stderr)
    try:
        trainer.run()
    except TrainingInterrupted as stop:
        print(f"deployrl train: {stop}", file=sys.stderr)
        return 128 + stop.signum  # the shell's convention for "killed by this signal"
    except (TrainingError, CheckpointError, OSError) as err:
        last = latest_checkpoint(trainer.run_dir)
        print(f"deployrl train: error: {err}\nthe last checkpoint is {last or 'none (a resume starts over)'};"
              f" resume with: {resume_command}", file=sys.stderr)
        return 1
    if trainer.world.is_main:  # what the run bought, from its whole metrics.jsonl (resumed runs too)
        from deployrl.training.runlog import METRICS, read_jsonl, run_summary

        rows = read_jsonl(trainer.run_dir / METRICS)
        print("\n".join([f"done: {trainer.run_dir}", *run_summary(rows, config.rollout.engine)]))
    if args.export:
        written = trainer.export(Path(args.export))
        if written:
            print("exported: " + ", ".join(str(p) for p in written.values()))
    trainer.close()
    close_world(trainer.world)
    return 0
