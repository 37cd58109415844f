"""The train/inference mismatch experiment: one task, one seed, one budget, many corrections.

SmolLM2-135M-Instruct trains in fp32 while a quantised engine samples (llama.cpp Q4_1, or
PyTorch fp8); each arm changes only how the mismatch is handled. Every arm is a plain
`deployrl train` run of `base.yaml` plus the overrides below, so any single arm can be re-run
by hand. Finished arms are skipped, so the script can be stopped and started again.

    python experiments/mismatch/run.py                   # all arms, then the report
    python experiments/mismatch/run.py --arms q4_none q4_dc
    python experiments/mismatch/run.py --report          # tables and plots from finished arms

The report (`report.md`, `plots/*.png` in the output folder) puts the arms side by side:
training reward, deployment-engine eval reward before/during/after training, mean delta,
lambda and the fraction of tokens whose delta exceeds c.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
Q4, FP8 = "rollout.engine=llamacpp:q4_1", "rollout.engine=hf:fp8"
# name -> (what it tests, overrides on base.yaml); ordered by importance, since a short session
# may finish only the first ones.
ARMS: dict[str, tuple[str, list[str]]] = {
    "fp32_ref": ("fp32 trainer, fp32 sampler: no mismatch", ["rollout.engine=hf:fp32", "algo.correction=none"]),
    "q4_none": ("Q4_1 sampler, no correction", [Q4, "algo.correction=none"]),
    "q4_dc": ("Q4_1 sampler, DC-GRPO (defaults)", [Q4, "algo.correction=dc"]),
    "q4_tis": ("Q4_1 sampler, truncated importance sampling", [Q4, "algo.correction=tis"]),
    "q4_mask": ("Q4_1 sampler, ratio-band masking", [Q4, "algo.correction=mask"]),
    "fp8_none": ("fp8 sampler, no correction", [FP8, "algo.correction=none"]),
    "fp8_dc": ("fp8 sampler, DC-GRPO (defaults)", [FP8, "algo.correction=dc"]),
    "q4_dc_c_low": ("DC, c = 0.5 x initial delta (too low)", [Q4, "algo.correction=dc", "algo.dc.relative_tolerance=0.5"]),
    "q4_dc_c_high": ("DC, c = 8 x initial delta (too high)", [Q4, "algo.correction=dc", "algo.dc.relative_tolerance=8"]),
    "q4_dc_ratio": ("DC, delta = |p_old/p_inf - 1|", [Q4, "algo.correction=dc", "algo.dc.signal=ratio"]),
    "q4_dc_log": ("DC, delta = |logp_old - logp_inf|", [Q4, "algo.correction=dc", "algo.dc.signal=log"]),
    "q4_dc_lam0": ("DC, lambda_0 = 1", [Q4, "algo.correction=dc", "algo.dc.lam_init=1"]),
    "q4_dc_eta": ("DC, dual step eta = 50", [Q4, "algo.correction=dc", "algo.dc.lr=50"]),
    "fp8_tis": ("fp8 sampler, truncated importance sampling", [FP8, "algo.correction=tis"]),
    "fp8_mask": ("fp8 sampler, ratio-band masking", [FP8, "algo.correction=mask"]),
}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run_dir: Path, steps: int) -> bool:
    rows = read_metrics(run_dir)
    return any(r["step"] == steps and "eval/pass@1" in r for r in rows)


def run_arm(name: str, out: Path, steps: int, extra: list[str]) -> float:
    run_dir = out / name
    if finished(run_dir, steps):
        print(f"[{name}] already finished, skipped")
        return 0.0
    resume = ["--resume"] if (run_dir / "checkpoints").exists() else []
    command = [
        sys.executable, "-m", "deployrl", "train", str(HERE / "base.yaml"), *ARMS[name][1],
        f"steps={steps}", f"output_dir={run_dir}", *extra, *resume,
    ]
    print(f"[{name}] {ARMS[name][0]}\n  " + " ".join(command[2:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(out: Path, steps: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {name: read_metrics(out / name) for name in ARMS if finished(out / name, steps)}
    if not done:
        raise SystemExit(f"no finished arm in {out}")
    quarter = max(1, steps // 4)
    lines = [
        f"| arm | what | reward, first {quarter} steps | reward, last {quarter} steps | eval pass@1 before → after"
        " | mean δ, first → last step | c | λ at the end | tokens over c, last step | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in done.items():
        _, reward = series(rows, "reward/mean")
        evals = dict(zip(*series(rows, "eval/pass@1")))
        _, delta = series(rows, "dc/mean_D")
        _, over = series(rows, "dc/frac_over_tolerance")
        _, lam = series(rows, "dc/lambda")
        _, seconds = series(rows, "time/step")
        tolerance = series(rows, "dc/tolerance")[1]
        before = f"{evals[0]:.3f}" if 0 in evals else "–"
        lines.append(
            f"| {name} | {ARMS[name][0]} | {mean_of(reward[:quarter]):.3f} | {mean_of(reward[-quarter:]):.3f}"
            f" | {before} → {evals.get(steps, float('nan')):.3f} | {delta[0]:.4f} → {delta[-1]:.4f}"
            f" | {tolerance[0]:.4f} | {lam[-1]:.2f} | {over[-1]:.3f} | {mean_of(seconds):.1f} |"
        )
    table = "\n".join(lines)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    panels = [
        ("reward/mean", "training reward (engine samples)"),
        ("eval/pass@1", "eval pass@1 in the deployment engine"),
        ("dc/mean_D", "mean discrepancy D"),
        ("dc/lambda", "lambda"),
        ("dc/frac_over_tolerance", "fraction of tokens with delta > c"),
    ]
    groups = {
        "corrections": [n for n in done if not any(t in n for t in ("_c_", "_ratio", "_log", "_lam0", "_eta"))],
        "ablations": [n for n in done if n in ("q4_dc",) or any(t in n for t in ("_c_", "_ratio", "_log", "_lam0", "_eta"))],
    }
    for group, names in groups.items():
        if not names:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
        for ax, (key, title) in zip(axes, panels):
            for name in names:
                x, y = series(done[name], key)
                ax.plot(x, y, marker="o" if key.startswith("eval") else None, ms=3, label=name)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"mismatch_{group}.png", dpi=110)
        plt.close(fig)
    (out / "report.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS), metavar="ARM",
                        help="arms to run, in order (default: all): " + ", ".join(ARMS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("runs/mismatch"))
    parser.add_argument("--report", action="store_true", help="only write the report of finished arms")
    parser.add_argument("overrides", nargs="*", default=[], help="extra key=value overrides for every arm")
    args = parser.parse_args(argv)
    if not args.report:
        for name in args.arms:
            seconds = run_arm(name, args.out, args.steps, args.overrides)
            if seconds:
                print(f"[{name}] {seconds / 60:.1f} min", flush=True)
    print(report(args.out, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
