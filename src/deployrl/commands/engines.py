"""`deployrl engines`: what each engine will do on this machine, before you start a run with it.

It reads this CPU's instruction sets and class (deployrl.cpu), whether a GPU and each engine's
library are installed, and prints for every engine spec: whether it runs here, what is known to be
slow here and the faster choice (the warning the engine logs when it starts), and the tokens/s
measured on this CPU class (docs/engines.md, "Engines per CPU class"), or nothing where not measured.
Nothing loads a model: it takes a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from deployrl.cpu import Cpu, this_cpu
from deployrl.engines import ENGINES
from deployrl.engines.measured import compared
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting


@dataclass(frozen=True)
class EnginesCommandConfig:
    """`deployrl engines`: every engine spec, and what it will do on this machine."""

    json: bool = setting(False, "print the verdicts as JSON (one object per engine spec) instead of a table")


FLAGS = (Flag("--json", "json", "print JSON instead of a table", const=True),)


def verdicts(cpu: Cpu, cuda: bool, installed: Optional[dict[str, bool]] = None) -> list[dict]:
    """One row per engine spec: {"engine", "here", "measured"}: what it does on `cpu` (with a GPU when
    `cuda`) and the tokens/s measured on the CPU's class ('' if not). `installed`: kind -> whether its
    library is there (None: look)."""
    rows = []
    for name in ENGINES:
        kind = ENGINES.get(name)
        present = kind.installed() if installed is None else installed[name]
        for option in kind.options:
            spec = f"{name}:{option}"
            here = kind.on_machine(option, cpu, cuda) if present else f"not installed: {kind.library[1]}"
            rows.append({"engine": spec, "here": here, "measured": "" if cuda else compared(spec, cpu.cls)})
    return rows


def main(argv: list[str] | None = None) -> int:
    config, _ = CommandLine("deployrl engines", EnginesCommandConfig, __doc__.split("\n\n")[0], FLAGS).parse(argv)
    cpu, cuda = this_cpu(), torch.cuda.is_available()
    rows = verdicts(cpu, cuda)
    if config.json:
        print(json.dumps({"cpu": cpu.describe(), "cpu_class": cpu.cls.value, "cuda": cuda, "engines": rows}, indent=2))
        return 0
    print(f"machine: {cpu.describe()}")
    print(f"class {cpu.cls.value}: {cpu.cls.help}")
    print("GPU: " + (torch.cuda.get_device_name() if cuda else "none (engines run on the CPU)"))
    print("[measured]: tokens/s on this CPU class at the shape of docs/engines.md, and the ratio to llama.cpp Q4_1\n")
    width = max(len(row["engine"]) for row in rows)
    for row in rows:
        print(f"{row['engine']:<{width}}  {row['here']}" + (f"  [measured {row['measured']}]" if row["measured"] else ""))
    return 0
