"""One rank of tests/test_distributed.py, started by torchrun (never collected by pytest):

    torchrun --nproc_per_node=N distributed_worker.py [--resume] [--fail-rank R] TINY_DIR ROOT
             VARIANT[,VARIANT...] [-- OVERRIDES]

trains test_trainer's toy configuration with each VARIANT's options into ROOT/VARIANT/run. Every
rank writes ROOT/VARIANT/rank{r}.json (λ, loss, reward, gradient norm and δ per step); rank 0 writes the final
weights to ROOT/VARIANT/weights.safetensors. With --fail-rank R, rank R raises in its first update.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from test_trainer import VARIANTS, toy_config

from deployrl.training.distributed import close_world, full_state_dict, init_world
from deployrl.training.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tiny_dir", type=Path)
    parser.add_argument("root", type=Path)
    parser.add_argument("variants", type=lambda text: text.split(","))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for variant in args.variants:
        run(args.tiny_dir, args.root / variant, [*VARIANTS[variant], *args.overrides], args.resume, args.fail_rank)
    close_world(init_world())


def run(tiny_dir: Path, root: Path, overrides: list[str], resume: bool, fail_rank) -> None:
    trainer = Trainer(toy_config(root, tiny_dir, *overrides), resume=resume)
    rank = trainer.world.rank
    if rank == fail_rank:
        def fail(*_, **__):
            raise RuntimeError(f"injected failure on rank {rank}")

        trainer.learner.update = fail
    history = [m for m in trainer.run() if "loss" in m]
    (root / f"rank{rank}.json").write_text(json.dumps({
        "lambda": [m["dc/lambda"] for m in history], "loss": [m["loss"] for m in history],
        "reward": [m["reward/mean"] for m in history], "grad_norm": [m["grad_norm"] for m in history],
        "delta": [m.get("dc/mean_D") for m in history],
    }))
    weights = full_state_dict(trainer.model, trainer.world)
    if rank == 0:
        save_file({k: v.clone().contiguous() for k, v in weights.items()}, root / "weights.safetensors")
    trainer.close()
    assert not trainer.world.distributed or dist.is_initialized(), "closing the trainer destroyed the process group"

if __name__ == "__main__":
    main()
