"""`deployrl train`: a YAML config plus dotted overrides, or the embedded default."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deployrl train",
        description=(
            "RL post-training against the deployment engine. With no arguments: the embedded default"
            " (SmolLM2-135M-Instruct, reasoning-gym arithmetic, fp32 trainer, llama.cpp Q4_1 sampling,"
            " DC-GRPO + PS-PPO). Overrides are section.key=value, e.g. algo.dc.tolerance=0.01."
        ),
    )
    parser.add_argument("items", nargs="*", metavar="[config.yaml] [key=value ...]",
                        help="an optional YAML config file, then dotted overrides")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="after training, write the final model as an HF folder (and a GGUF) to DIR")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)

    from deployrl.config import load_config, split_config_items
    from deployrl.configio import ConfigError, to_dict

    try:
        config = load_config(*split_config_items(args.items))
    except ConfigError as err:
        parser.exit(2, f"deployrl train: error: {err}\n")
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0

    from deployrl.trainer import Trainer

    trainer = Trainer(config, resume=args.resume)
    trainer.run()
    if args.export:
        written = trainer.export(Path(args.export))
        print("exported: " + ", ".join(str(p) for p in written.values()))
    return 0
