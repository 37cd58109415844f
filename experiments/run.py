"""Run an experiment: the arms of `experiments/<name>/arms.yaml`, then a side-by-side report.

Every arm is a plain `deployrl train <name>/base.yaml <overrides>` run, so any arm can be re-run
by hand with the command this script prints. Finished arms are skipped and an interrupted arm
resumes from its last checkpoint, so the script can be stopped and started again.

    python experiments/run.py mismatch                       # every arm in order, then the report
    python experiments/run.py mismatch --arms q4_none q4_dc  # some arms
    python experiments/run.py ps_accuracy --report           # the report of the finished arms
    python experiments/run.py mismatch --arms lora_q4_none lora_q4_dc --seeds 0 1 2 --baseline lora_q4_none \
        eval.num_prompts=128 eval.samples=4                  # each arm once per seed, means and intervals

The report goes to `<out>/report.md` and `<out>/plots/*.png` (out: `runs/<name>`): per arm the
training reward over the first and last quarter of the steps, the deployment-engine eval
before / after training and at equal wall time (the fastest arm's total), mean discrepancy,
tolerance c, lambda, fraction of tokens over c, seconds per step and tokens backpropagated.
With `--seeds`, each arm runs once per seed (`<out>/<arm>/seed<N>`, the seed set last so it wins
over an arm's own) and the report (`<out>/report_seeds.md`, `plots/seeds.png` and one
`plots/<group>_seeds.png` per plot group: D per step for each seed, or the eval against training
minutes where arms.yaml sets `seeds_panel: eval_by_time`, beside the end scores) gives per arm the
mean and 95% t-interval over seeds of the eval before and after training and at equal wall time
(per seed, the fastest arm's total), with `--baseline` the paired difference to that arm, seed by
seed, with its interval, and the median update seconds and tokens backpropagated per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from deployrl.commands.bench.vs_trl import interval

HERE = Path(__file__).resolve().parent
PANELS = {
    "reward/mean": "training reward (engine samples)",
    "eval/pass@1": "eval pass@1 in the deployment engine",
    "eval_by_time": "eval pass@1 against wall time (min)",
    "dc/mean_D": "mean discrepancy D",
    "dc/lambda": "lambda",
    "dc/frac_over_tolerance": "fraction of tokens with delta > c",
    "ps/tokens_graded": "tokens backpropagated per step",
}


def load_experiment(name: str) -> dict:
    """arms.yaml of experiments/<name>, or of the folder `name`."""
    folder = HERE / name if (HERE / name / "arms.yaml").exists() else Path(name)
    if not (folder / "arms.yaml").exists():
        raise SystemExit(f"{name}: neither an experiment in {HERE} nor a folder with an arms.yaml")
    spec = yaml.safe_load((folder / "arms.yaml").read_text())
    spec["base"] = folder / spec.get("base", "base.yaml")
    return spec


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run_dir: Path, steps: int) -> bool:
    return any(r["step"] == steps and "eval/pass@1" in r for r in read_metrics(run_dir))


def run_arm(spec: dict, name: str, out: Path, steps: int, extra: list[str], seed: Optional[int] = None) -> None:
    run_dir = out / name if seed is None else out / name / f"seed{seed}"
    label = name if seed is None else f"{name}, seed {seed}"
    if finished(run_dir, steps):
        print(f"[{label}] already finished, skipped", flush=True)
        return
    arm = spec["arms"][name]
    extra = extra if seed is None else [*extra, f"seed={seed}"]
    # a run stopped before its first checkpoint left logs only: --resume starts it over
    resume = ["--resume"] if run_dir.is_dir() and any(run_dir.iterdir()) else []
    command = [
        sys.executable, "-m", "deployrl", "train", str(spec["base"]), *arm["overrides"],
        f"steps={steps}", f"output_dir={run_dir}", *extra, *resume,
    ]
    print(f"[{label}] {arm['about']}\n  deployrl " + " ".join(command[3:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    print(f"[{label}] {(time.perf_counter() - start) / 60:.1f} min", flush=True)


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def eval_by_time(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(cumulative training minutes, eval pass@1) at each evaluation; eval time not counted."""
    elapsed, minutes = 0.0, {0: 0.0}
    for r in rows:
        if r.get("time/step") is not None:
            elapsed += r["time/step"] / 60
            minutes[r["step"]] = elapsed
    steps, values = series(rows, "eval/pass@1")
    return [minutes[s] for s in steps], values


def at_time(curve: tuple[list[float], list[float]], limit: float) -> float:
    """The last evaluation made within `limit` minutes of training."""
    within = [v for t, v in zip(*curve) if t <= limit + 1e-9]
    return within[-1] if within else float("nan")


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(spec: dict, out: Path, steps: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {name: read_metrics(out / name) for name in spec["arms"] if finished(out / name, steps)}
    if not done:
        raise SystemExit(f"no finished arm in {out}")
    quarter = max(1, steps // 4)
    curves = {name: eval_by_time(rows) for name, rows in done.items()}
    equal_time = min(curve[0][-1] for curve in curves.values())
    headers = [
        "arm", "what", f"reward, first {quarter} steps", f"reward, last {quarter} steps", "eval before",
        f"eval after {steps} steps", f"eval at {equal_time:.1f} min", "mean δ first → last", "c", "λ end",
        "tokens over c (last)", "s/step", "tokens backprop / step",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, rows in done.items():
        reward = series(rows, "reward/mean")[1]
        evals = dict(zip(*series(rows, "eval/pass@1")))
        delta = series(rows, "dc/mean_D")[1]
        lam = series(rows, "dc/lambda")[1]
        cells = [
            name, spec["arms"][name]["about"], f"{mean_of(reward[:quarter]):.3f}", f"{mean_of(reward[-quarter:]):.3f}",
            f"{evals[0]:.3f}" if 0 in evals else "–", f"{evals.get(steps, float('nan')):.3f}",
            f"{at_time(curves[name], equal_time):.3f}", f"{delta[0]:.4f} → {delta[-1]:.4f}",
            f"{series(rows, 'dc/tolerance')[1][0]:.4f}", f"{lam[-1]:.2f}",
            f"{series(rows, 'dc/frac_over_tolerance')[1][-1]:.3f}", f"{mean_of(series(rows, 'time/step')[1]):.1f}",
            f"{mean_of(series(rows, 'ps/tokens_graded')[1]):.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    panels = spec.get("panels", list(PANELS))
    for group, names in spec.get("plots", {"all": list(spec["arms"])}).items():
        names = [n for n in names if n in done]
        if not names:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.3), squeeze=False)
        for ax, key in zip(axes[0], panels):
            for name in names:
                x, y = curves[name] if key == "eval_by_time" else series(done[name], key)
                ax.plot(x, y, marker="o" if key.startswith("eval") else None, ms=3, label=name)
            ax.set_title(PANELS[key], fontsize=9)
            ax.set_xlabel("minutes" if key == "eval_by_time" else "step")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"{group}.png", dpi=110)
        plt.close(fig)
    (out / "report.md").write_text(table + "\n")
    return table


def seeded_report(spec: dict, out: Path, steps: int, seeds: list[int], baseline: Optional[str]) -> str:
    """Per arm, over the seeds finished: eval before / after and at equal wall time (mean ± 95%
    interval), the paired difference to `baseline` at both, mean δ first → last, c and λ at the end,
    the median update seconds per step and the tokens backpropagated per step. Equal time is set
    seed by seed: the shortest total training time among the arms finished with that seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: {seed: read_metrics(out / name / f"seed{seed}") for seed in seeds
                   if finished(out / name / f"seed{seed}", steps)} for name in spec["arms"]}
    runs = {name: by_seed for name, by_seed in runs.items() if by_seed}
    if not runs:
        raise SystemExit(f"no finished seeded arm in {out}")

    def evals(rows: list[dict]) -> dict[int, float]:
        return dict(zip(*series(rows, "eval/pass@1")))

    def cell(values: list[float]) -> str:
        if len(values) < 2:
            return f"{values[0]:.3f} (one seed)" if values else "–"
        mean, half = interval(values)
        return f"{mean:.3f} ± {half:.3f}"

    curves = {name: {seed: eval_by_time(rows) for seed, rows in by_seed.items()} for name, by_seed in runs.items()}
    finished_seeds = {seed for by_seed in curves.values() for seed in by_seed}
    equal_time = {seed: min(by_seed[seed][0][-1] for by_seed in curves.values() if seed in by_seed)
                  for seed in finished_seeds}
    headers = ["arm", "what", "seeds", "eval before", f"eval after {steps} steps",
               f"after − {baseline}" if baseline else "after − before", "eval at equal time",
               f"at equal time − {baseline}" if baseline else "at equal time − before", "mean δ first → last", "c",
               "λ end", "update s/step (median)", "tokens backprop / step"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    ends, at_equal_time = {}, {}
    for name, by_seed in runs.items():
        made = {seed: evals(rows) for seed, rows in by_seed.items()}
        before = {seed: scores[0] for seed, scores in made.items() if 0 in scores}
        ends[name] = {seed: scores[steps] for seed, scores in made.items()}
        at_equal_time[name] = {seed: at_time(curve, equal_time[seed]) for seed, curve in curves[name].items()}
        references = {"end": ends.get(baseline, {}), "time": at_equal_time.get(baseline, {})} if baseline else \
            {"end": before, "time": before}
        paired = {key: [scores[seed] - references[key][seed] for seed in by_seed if seed in references[key]]
                  for key, scores in (("end", ends[name]), ("time", at_equal_time[name]))}
        delta = [series(rows, "dc/mean_D")[1] for rows in by_seed.values()]
        update = [statistics.median(series(rows, "time/update")[1]) for rows in by_seed.values()]
        lines.append("| " + " | ".join([
            name, spec["arms"][name]["about"], ", ".join(map(str, by_seed)), cell(list(before.values())),
            cell(list(ends[name].values())), "–" if name == baseline else cell(paired["end"]),
            cell(list(at_equal_time[name].values())), "–" if name == baseline else cell(paired["time"]),
            f"{mean_of([d[0] for d in delta]):.4f} → {mean_of([d[-1] for d in delta]):.4f}",
            f"{mean_of([series(rows, 'dc/tolerance')[1][0] for rows in by_seed.values()]):.4f}",
            f"{mean_of([series(rows, 'dc/lambda')[1][-1] for rows in by_seed.values()]):.2f}",
            f"{mean_of(update):.1f}",
            f"{mean_of([mean_of(series(rows, 'ps/tokens_graded')[1]) for rows in by_seed.values()]):.0f}",
        ]) + " |")
    table = "\n".join(lines)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    groups = {"seeds": list(ends)} | {f"{group}_seeds": [n for n in names if n in ends]
                                      for group, names in spec.get("plots", {}).items()}
    for group, names in groups.items():
        if names:
            seeds_figure(plt, out / "plots" / f"{group}.png", {n: runs[n] for n in names}, ends, steps,
                         spec.get("seeds_panel", "dc/mean_D"))
    (out / "report_seeds.md").write_text(table + "\n")
    return table


def seeds_figure(plt, path: Path, runs: dict[str, dict[int, list[dict]]], ends: dict[str, dict[int, float]],
                 steps: int, key: str) -> None:
    """`key` (a PANELS key: mean D per step, or eval against training minutes), one line per seed,
    coloured by arm (log scale where it spans a decade), beside each arm's eval after training:
    every seed (grey), the mean and its 95% interval (black)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(2.0 * len(runs) + 6, 3.5))
    for colour, (name, by_seed) in enumerate(runs.items()):
        for i, rows in enumerate(by_seed.values()):
            x, y = eval_by_time(rows) if key == "eval_by_time" else series(rows, key)
            left.plot(x, y, color=f"C{colour}", marker="o" if key.startswith("eval") else None, ms=3,
                      label=name if i == 0 else None)
    drawn = [y for line in left.get_lines() for y in line.get_ydata()]
    if drawn and min(drawn) > 0 and max(drawn) > 10 * min(drawn):
        left.set_yscale("log")
    left.set_xlabel("minutes" if key == "eval_by_time" else "step")
    left.set_title(PANELS[key] + ", each seed", fontsize=9)
    left.legend(fontsize=7)
    for x, name in enumerate(runs):
        values = list(ends[name].values())
        right.scatter([x] * len(values), values, s=12, color="grey")
        if len(values) > 1:
            mean, half = interval(values)
            right.errorbar([x], [mean], yerr=[half], fmt="o", color="black", capsize=4)
    right.set_xticks(range(len(runs)), list(runs), rotation=30, ha="right", fontsize=8)
    right.set_ylabel(f"eval pass@1 after {steps} steps")
    right.set_title("each seed (grey), mean and 95% interval (black)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    experiments = sorted(p.parent.name for p in HERE.glob("*/arms.yaml"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", help=f"{', '.join(experiments)}, or a folder with base.yaml and arms.yaml")
    parser.add_argument("--arms", nargs="*", default=None, metavar="ARM", help="arms to run, in order (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the experiment's)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: runs/<experiment>)")
    parser.add_argument("--report", action="store_true", help="only write the report of the finished arms")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, metavar="N",
                        help="run each arm once per seed (the report gives means and 95%% intervals)")
    parser.add_argument("--baseline", default=None, metavar="ARM",
                        help="with --seeds: report each arm's paired difference to this arm")
    parser.add_argument("overrides", nargs="*", default=[], help="extra key=value overrides for every arm")
    args = parser.parse_intermixed_args(argv)
    spec = load_experiment(args.experiment)
    steps = args.steps or spec["steps"]
    out = args.out or Path("runs") / Path(args.experiment).name
    arms = args.arms if args.arms is not None else list(spec["arms"])
    unknown = [a for a in arms if a not in spec["arms"]]
    if unknown or args.baseline not in (None, *spec["arms"]):
        parser.error(f"unknown arm(s) {unknown or [args.baseline]}; {args.experiment} has: {', '.join(spec['arms'])}")
    if args.baseline and not args.seeds:
        parser.error("--baseline compares seeds: give --seeds too")
    if not args.report:
        for seed in args.seeds or [None]:
            for name in arms:
                run_arm(spec, name, out, steps, args.overrides, seed)
    print(seeded_report(spec, out, steps, args.seeds, args.baseline) if args.seeds else report(spec, out, steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
