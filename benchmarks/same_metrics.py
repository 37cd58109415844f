"""Do two runs give the same metrics? For a refactor that must not change behaviour.

Run the same fixed-seed job on the code before and after (e.g. a git worktree of the old commit
on PYTHONPATH), on the same machine, then compare their metrics.jsonl step by step:

    PYTHONPATH=/tmp/old/src deployrl train steps=3 eval.num_prompts=0 output_dir=runs/before
    deployrl train steps=3 eval.num_prompts=0 output_dir=runs/after
    python benchmarks/same_metrics.py runs/before runs/after [--rel 1e-4]

Seconds and rates (`time/*`, `*per_s`) are the machine's and are skipped. Every other metric of
the first run must be in the second, within `--rel` (relative, with an absolute floor of
1e-6), NaN where it was NaN. Exits 1 on any difference. On one machine llama.cpp and the fp32
trainer are deterministic, so the differences seen are 0 or a changed behaviour; on two CPUs
native kernels differ, and sampling can diverge (tests/test_same_metrics.py is the CPU-proof check).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def steps(run: Path) -> list[dict]:
    """The per-step metric lines of a run's metrics.jsonl (evaluation-only lines left out)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if "loss" in line or "reward/mean" in line]


def is_speed(key: str) -> bool:
    return key.startswith("time/") or key.endswith("per_s")


def differences(before: list[dict], after: list[dict], rel: float) -> tuple[list[str], int]:
    """The differing (step, metric) pairs, described, and the number of values compared."""
    found, compared = [], 0
    if len(before) != len(after):
        found.append(f"{len(before)} steps before, {len(after)} after")
    for index, (old, new) in enumerate(zip(before, after), start=1):
        for key, value in old.items():
            if is_speed(key) or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            compared += 1
            got = new.get(key)
            if got is None:
                found.append(f"step {index}: {key} is gone")
            elif math.isnan(value) != math.isnan(got) or (
                    not math.isnan(value) and abs(got - value) > max(rel * abs(value), 1e-6)):
                found.append(f"step {index}: {key} {value!r} -> {got!r}")
    return found, compared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rel", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    args = parser.parse_args(argv)
    found, compared = differences(steps(args.before), steps(args.after), args.rel)
    for line in found:
        print(line)
    print(f"{compared} values compared over {len(steps(args.before))} steps: {len(found)} differ")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
