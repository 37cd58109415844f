"""`deployrl bench vs-trl`: deployrl against TRL at equal wall time, scored in the deployed engine.

For each task, seed and arm, one training run in a fresh process, one at a time, with the same
wall-clock budget (`--budget-min`, counted from before the model loads, so a framework's start-up
is charged to it), keeping the LoRA adapter at fixed wall times (`--keep-every-min`): the adapter
kept at minute m is the newest one whose step had finished by m (the step that crosses m is not
charged to it). Arms:

* ``trl``: TRL's GRPOTrainer with a peft LoRA of deployrl's rank, alpha and target modules, on the
  embedded GGUF dequantised once to an fp32 HF folder; deployrl's prompts in deployrl's order, K,
  prompts per step, completion length, temperature, learning rate and warmup, no KL, token-mean
  loss (TRL's ``dapo``), one iteration; TRL samples with transformers' ``generate`` (its CPU path).
* ``deployrl``: ``deployrl train`` as shipped (llama.cpp Q4_1 sampling, DC-GRPO, PS-PPO).
* ``deployrl_hf``: the same with TRL's engine (``rollout.engine=hf:fp32``), on the first task only,
  so that the engine's share of a difference shows.

Afterwards (not charged to any budget) every kept adapter, and the base model at minute 0, is
scored by ``deployrl eval`` on the task's held-out problems in each of ``--eval-engines``: the
deployed engine (llama.cpp Q4_1 with the adapter as a GGUF LoRA; TRL's adapter goes through the
same conversion) and fp32 transformers (the precision TRL trains in). The evaluation's sampling
seed is the run's seed, so the arms of one seed are scored on the same draws.

Everything lands in ``--out``: ``<task>/<arm>/seed<s>/`` (``adapters/<seconds>s/`` in peft's layout,
``steps.jsonl`` with each step's seconds split into generation / update / sync, ``run.json`` once
the run finished, ``eval/<engine>/<seconds>s.json``), then ``report.md``, ``results.json`` and
``plots/<task>.png``. The command resumes: a finished run and a written score are never redone; a
run interrupted before its ``run.json`` starts over (a wall-clock budget cannot be resumed
fairly: the second start-up would be charged to it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from deployrl.algo._checks import check_positive
from deployrl.commands.bench.measure import in_fresh_process, table
from deployrl.commands.bench.step import default_cache_dir, environment, hf_model_dir, parse_with_overrides
from deployrl.engines import engine_help, parse_engine_spec
from deployrl.registry import unknown_name_error
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting

# the second task: three one-digit terms instead of two (the base model scores about 0.05, against
# about 0.19 on the default)
THREE_TERMS = ("task.rg_config={min_terms: 3, max_terms: 3, min_digits: 1, max_digits: 1, operators: ['+', '-'],"
               " allow_parentheses: false, allow_negation: false}")
TASKS = {  # name -> (what it is, deployrl train overrides)
    "arithmetic": ("reasoning-gym arithmetic, two one-digit terms (the embedded default)", []),
    "arithmetic3": ("reasoning-gym arithmetic, three one-digit terms", [THREE_TERMS]),
}
ARMS = {  # name -> (label, framework, deployrl train overrides, on the first task only)
    "trl": ("TRL GRPOTrainer (LoRA, transformers generate)", "trl", [], False),
    "deployrl": ("deployrl as shipped (llama.cpp Q4_1, DC-GRPO, PS-PPO)", "deployrl", [], False),
    "deployrl_hf": ("deployrl with TRL's engine (hf:fp32)", "deployrl", ["rollout.engine=hf:fp32"], True),
}
BASE = "base"  # the untrained model's scores, minute 0 of every arm
SECONDS = ("step_s", "generation_s", "update_s", "sync_s")  # a step's seconds and their split


@dataclass(frozen=True)
class VsTrlConfig:
    """The experiment's own settings; the training settings are overrides of the embedded default."""

    out: str = setting("runs/vs_trl", "the experiment's folder; a second call resumes what is there")
    budget_min: float = setting(12.0, "wall-clock minutes of each training run, start-up included")
    keep_every_min: float = setting(3.0, "minutes between kept adapters (and one at the budget)")
    seeds: tuple[int, ...] = setting((0, 1, 2), "the runs' seeds (data order, sampling, adapter initialisation)")
    tasks: tuple[str, ...] = setting(tuple(TASKS), lambda: "tasks: " + "; ".join(
        f"{name}: {about}" for name, (about, _) in TASKS.items()))
    arms: tuple[str, ...] = setting(tuple(ARMS), lambda: "arms: " + "; ".join(
        f"{name}: {label}" for name, (label, *_) in ARMS.items()))
    eval_problems: int = setting(128, "held-out problems per score")
    eval_samples: int = setting(4, "completions per problem (pass@1 is their mean)")
    eval_engines: tuple[str, ...] = setting(("llamacpp:q4_1", "hf:fp32"), lambda: "the engines that score every"
                                            f" adapter, the first the deployed one: {engine_help()}")
    model: str = setting("smollm2-135m", "the model: the smollm2-135m alias or a .gguf file (llama.cpp samples"
                                         " and scores from it)")
    cache_dir: Optional[str] = setting(None, "where the GGUF is dequantised for TRL, once (None: as bench step)")
    trl_micro_batch: int = setting(16, "TRL completions per forward/backward (as bench step)")
    report: bool = setting(False, "only write the report of what is finished")

    def __post_init__(self) -> None:
        for minutes in ("budget_min", "keep_every_min", "eval_problems", "eval_samples", "trl_micro_batch"):
            check_positive(minutes, getattr(self, minutes))
        for kind, names, valid in (("task", self.tasks, TASKS), ("arm", self.arms, ARMS)):
            for name in names:
                if name not in valid:
                    raise unknown_name_error(kind, name, list(valid))
        for engine in self.eval_engines:
            parse_engine_spec(engine)
        if not self.seeds or not self.tasks or not self.arms or not self.eval_engines:
            raise ValueError("seeds, tasks, arms and eval_engines each need at least one entry")

    @property
    def marks(self) -> list[float]:
        """The wall-clock seconds at which adapters are kept, the budget last."""
        budget, every = 60 * self.budget_min, 60 * self.keep_every_min
        marks = [round(every * i, 3) for i in range(1, math.ceil(budget / every - 1e-9))]
        return [*marks, round(budget, 3)]

    def runs(self) -> list[tuple[str, str, int]]:
        """(task, arm, seed) of every run, seed by seed so that a partial experiment compares arms."""
        return [(task, arm, seed) for seed in self.seeds for task in self.tasks for arm in self.arms
                if not ARMS[arm][3] or task == self.tasks[0]]


FLAGS = (
    Flag("--out", "out"),
    Flag("--budget-min", "budget_min"),
    Flag("--keep-every-min", "keep_every_min"),
    Flag("--seeds", "seeds", many=True),
    Flag("--tasks", "tasks", many=True),
    Flag("--arms", "arms", many=True),
    Flag("--eval-problems", "eval_problems"),
    Flag("--eval-samples", "eval_samples"),
    Flag("--eval-engines", "eval_engines", many=True),
    Flag("--model", "model"),
    Flag("--cache-dir", "cache_dir"),
    Flag("--trl-micro-batch", "trl_micro_batch"),
    Flag("--report", "report", const=True),
)


# --------------------------------------------------------------------------- one run, in its own process

class Keeper:
    """The wall clock of a run: keeps the adapter at each mark and says when the budget is spent.

    `snapshot()` returns the adapter's tensors (copies), `save(snapshot, folder)` writes them. Before
    each step the adapter is snapshotted; when a step ends past a mark, the snapshot from before it
    (the newest adapter finished by the mark) is kept for that mark. Saving is not charged to the clock.
    """

    def __init__(self, run_dir: Path, marks: list[float], snapshot: Callable[[], Any],
                 save: Callable[[Any, Path], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.run_dir, self.pending, self.snapshot, self.save, self.clock = run_dir, list(marks), snapshot, save, clock
        self.start, self.paused, self.previous = clock(), 0.0, None
        self.steps = 0

    def elapsed(self) -> float:
        return self.clock() - self.start - self.paused

    def before_step(self) -> None:
        began = self.clock()
        self.previous = self.snapshot()
        self.paused += self.clock() - began

    def after_step(self, record: dict[str, float]) -> bool:
        """Log the step and keep what is due; True once the budget is spent."""
        now, began = self.elapsed(), self.clock()
        self.steps += 1
        while self.pending and self.pending[0] <= now:
            self.save(self.previous, self.run_dir / "adapters" / f"{self.pending.pop(0):g}s")
        with open(self.run_dir / "steps.jsonl", "a") as file:
            file.write(json.dumps({"step": self.steps, "elapsed_s": now, **record}) + "\n")
        self.paused += self.clock() - began
        return not self.pending


def train_run(framework: str, overrides: list[str], seed: int, marks: list[float], run_dir: str, model_dir: str,
              micro_batch: int, max_steps: int) -> dict[str, Any]:
    """One run of `framework` (trl or deployrl) under the wall clock of `marks`; its summary."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True)
    if framework == "trl":
        return _train_trl(overrides, seed, marks, run_dir, model_dir, micro_batch, max_steps)
    return _train_deployrl(overrides, seed, marks, run_dir, max_steps)


def _train_deployrl(overrides: list[str], seed: int, marks: list[float], run_dir: Path, max_steps: int) -> dict:
    from deployrl.models.lora import adapter_state
    from deployrl.settings.config import load_config
    from deployrl.training.checkpoint import save_model
    from deployrl.training.trainer import Trainer

    config = load_config(None, [*overrides, f"seed={seed}", f"steps={max_steps}", f"output_dir={run_dir / 'run'}",
                                "eval.num_prompts=0", "tensorboard=false"])
    keeper = Keeper(run_dir, marks, lambda: {k: v.clone() for k, v in adapter_state(trainer.model).items()},
                    lambda weights, folder: save_model(trainer.model, None, folder, adapter=weights))
    trainer = Trainer(config)
    setup_s = keeper.elapsed()
    try:
        done = False
        while not done and keeper.steps < max_steps:
            keeper.before_step()
            metrics = trainer.step()
            sync = metrics.get("time/sync", 0.0)
            done = keeper.after_step({
                "step_s": metrics["time/step"], "generation_s": metrics["time/rollout"], "sync_s": sync,
                "update_s": metrics["time/step"] - metrics["time/rollout"] - sync,
                "reward": metrics.get("reward/mean", float("nan")),
            })
    finally:
        trainer.logger.close()
        trainer.close()
    return {"steps": keeper.steps, "setup_s": setup_s, "out_of_steps": bool(keeper.pending)}


def _train_trl(overrides: list[str], seed: int, marks: list[float], run_dir: Path, model_dir: str,
               micro_batch: int, max_steps: int) -> dict:
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    from deployrl.commands.bench.step import trl_trainer
    from deployrl.settings.config import load_config

    # TRL samples with transformers from the dequantised folder: hf:fp32 is that engine in deployrl's terms
    config = load_config(None, [*overrides, f"seed={seed}", f"model.name={model_dir}", "rollout.engine=hf:fp32"])
    lora = config.model.lora
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=sorted(lora.target_modules), task_type="CAUSAL_LM")

    def save(weights, folder: Path) -> None:
        folder.mkdir(parents=True)
        save_file(weights, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        copy.deepcopy(trainer.model.peft_config["default"]).save_pretrained(str(folder))

    keeper = Keeper(run_dir, marks, lambda: {k: v.detach().clone() for k, v in
                                             get_peft_model_state_dict(trainer.model).items()}, save)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            keeper.before_step()
            trainer.generation_s, self.start, self.scored = 0.0, time.perf_counter(), len(trainer.rewards)

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.start
            rewards = trainer.rewards[self.scored:]
            control.should_training_stop = keeper.after_step({
                "step_s": step_s, "generation_s": trainer.generation_s, "sync_s": 0.0,
                "update_s": step_s - trainer.generation_s,
                "reward": statistics.fmean(rewards) if rewards else float("nan"),
            })

    trainer = trl_trainer(config, micro_batch, max_steps, str(run_dir / "trl"), [Clock()], peft_config)
    setup_s = keeper.elapsed()
    trainer.train()
    shutil.rmtree(run_dir / "trl", ignore_errors=True)  # TRL's own output folder: nothing kept there
    return {"steps": keeper.steps, "setup_s": setup_s, "out_of_steps": bool(keeper.pending)}


def score(adapters: list[Optional[str]], outs: list[dict[str, str]], base: str, task_overrides: list[str],
          problems: int, samples: int, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """`deployrl eval`'s scores of each of `adapters` (None: the base alone) on `base`, in each engine
    of `outs[i]` (engine -> file), written to that file; the base model is loaded once for all of them."""
    from deployrl.commands.evaluate import EvalCommandConfig, score_in_engine
    from deployrl.models.loading import gguf_read_once, load_model, load_tokenizer, resolve_model
    from deployrl.models.lora import attach_adapter
    from deployrl.settings.parsing import load
    from deployrl.tasks import load_task

    config = load(EvalCommandConfig, None, [f"num_prompts={problems}", f"samples={samples}",
                                            f"max_new_tokens={max_new_tokens}", f"seed={seed}", *task_overrides])
    with gguf_read_once():
        source = resolve_model(base)
        tokenizer, base_model, task = load_tokenizer(source), load_model(source).eval(), load_task(config.task)
    for adapter, targets in zip(adapters, outs):
        model = base_model if adapter is None else attach_adapter(copy.deepcopy(base_model), Path(adapter))
        for engine, target in targets.items():
            scores = score_in_engine(engine, model, source, tokenizer, task, config)
            _write_json(Path(target), {"task": task.name, "model": adapter or base, "engine": engine, **scores})
    return {}


# --------------------------------------------------------------------------- the experiment

def _slug(engine: str) -> str:
    return engine.replace(":", "_")


def _held_out(task_overrides: list[str], seed: int) -> list[str]:
    """`deployrl eval` overrides for a run's held-out problems (the training task, its seed + 1)."""
    from deployrl.settings.config import held_out_task, load_config

    held = held_out_task(load_config(None, task_overrides))
    return [*task_overrides, f"task.seed={held.seed}"]


def _write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path` (its folder made), whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=2) + "\n")
    partial.replace(path)


def train_all(config: VsTrlConfig, overrides: list[str], model_dir: str) -> None:
    out = Path(config.out)
    max_steps = max(100, 10 * math.ceil(60 * config.budget_min))  # never the limit on a real machine
    for task, arm, seed in config.runs():
        run_dir = out / task / arm / f"seed{seed}"
        if (run_dir / "run.json").exists():
            continue
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts over (module docstring)
        label, framework, arm_overrides, _ = ARMS[arm]
        print(f"[{task} / {arm} / seed {seed}] {label}: {config.budget_min:g} min", file=sys.stderr, flush=True)
        summary = in_fresh_process("deployrl.commands.bench.vs_trl:train_run", {
            "framework": framework, "overrides": [*TASKS[task][1], *overrides, *arm_overrides], "seed": seed,
            "marks": config.marks, "run_dir": str(run_dir), "model_dir": model_dir,
            "micro_batch": config.trl_micro_batch, "max_steps": max_steps,
        })
        _write_json(run_dir / "run.json", {"task": task, "arm": arm, "seed": seed, "marks": config.marks, **summary})


def score_all(config: VsTrlConfig, overrides: list[str]) -> None:
    """Score the base model and every finished run's kept adapters, one process per run."""
    from deployrl.settings.config import load_config

    out = Path(config.out)
    for task in config.tasks:
        task_overrides = [*TASKS[task][1], *(o for o in overrides if o.startswith("task."))]
        max_new_tokens = load_config(None, [*TASKS[task][1], *overrides]).rollout.max_new_tokens
        for seed in config.seeds:
            runs = [(out / task / BASE / f"seed{seed}", {0.0: None})]
            for arm in config.arms:
                run_dir = out / task / arm / f"seed{seed}"
                if (run_dir / "run.json").exists():
                    runs.append((run_dir, {m: str(run_dir / "adapters" / f"{m:g}s") for m in config.marks}))
            for run_dir, adapters in runs:
                todo = {m: {e: str(f) for e in config.eval_engines if not (f := _score_file(run_dir, e, m)).exists()}
                        for m in adapters}
                todo = {m: files for m, files in todo.items() if files}  # a written score is never redone
                if not todo:
                    continue
                engines = sorted({e for files in todo.values() for e in files}, key=config.eval_engines.index)
                print(f"[{task} / seed {seed}] scoring {len(todo)} models of {run_dir} in "
                      + ", ".join(engines), file=sys.stderr, flush=True)
                in_fresh_process("deployrl.commands.bench.vs_trl:score", {
                    "adapters": [adapters[m] for m in todo], "outs": list(todo.values()), "base": config.model,
                    "task_overrides": _held_out(task_overrides, seed),
                    "problems": config.eval_problems, "samples": config.eval_samples,
                    "max_new_tokens": max_new_tokens, "seed": seed,
                })


def _score_file(run_dir: Path, engine: str, mark: float) -> Path:
    return run_dir / "eval" / _slug(engine) / f"{mark:g}s.json"


# --------------------------------------------------------------------------- the report

def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student-t interval); the half-width is nan for one value."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def _scores(out: Path, task: str, arm: str, seed: int, engine: str, marks: list[float]) -> Optional[list[float]]:
    """pass@1 at minute 0 (the base) and at each mark of one run; None if any is missing."""
    files = [_score_file(out / task / BASE / f"seed{seed}", engine, 0.0)]
    files += [_score_file(out / task / arm / f"seed{seed}", engine, m) for m in marks]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text())["pass@1"] for f in files]


def collect(config: VsTrlConfig) -> dict[str, Any]:
    """Per task and arm: the finished seeds' scores per engine, steps and seconds per step."""
    out, marks = Path(config.out), config.marks
    results: dict[str, Any] = {}
    for task in config.tasks:
        for arm in config.arms:
            runs = {}
            for seed in config.seeds:
                run_dir = out / task / arm / f"seed{seed}"
                if not (run_dir / "run.json").exists():
                    continue
                steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
                runs[seed] = {
                    **json.loads((run_dir / "run.json").read_text()),
                    "steps_by_mark": [sum(s["elapsed_s"] <= m for s in steps) for m in marks],
                    "seconds": {k: statistics.median(s[k] for s in steps) for k in SECONDS},
                    "pass@1": {e: _scores(out, task, arm, seed, e, marks) for e in config.eval_engines},
                }
            if runs:
                results.setdefault(task, {})[arm] = runs
    return results


def report(config: VsTrlConfig, results: dict[str, Any], header: list[str]) -> str:
    """The markdown report: per task, pass@1 against wall minutes per arm and engine (mean and 95%
    interval over seeds), the difference of each deployrl arm from TRL at equal time (paired by seed:
    same prompts, same evaluation draws), steps done and seconds per step."""
    minutes = [0.0, *(m / 60 for m in config.marks)]
    lines = ["# deployrl vs TRL at equal wall time", "", *header, ""]
    for task, arms in results.items():
        lines += [f"## {task}: {TASKS[task][0]}", ""]
        for engine in config.eval_engines:
            deployed = " (deployed)" if engine == config.eval_engines[0] else ""
            lines += [f"pass@1 in {engine}{deployed} ({config.eval_problems} problems x {config.eval_samples}"
                      " samples), mean ± 95% interval over seeds:", ""]
            rows = []
            for arm, runs in arms.items():
                scored = _scored(runs, engine)
                if scored:
                    rows.append([ARMS[arm][0], len(scored), *(_cell(interval([s[i] for s in scored]))
                                                                 for i in range(len(minutes)))])
            lines += [table(["arm", "seeds", *(f"{m:g} min" for m in minutes)], rows), ""]
            differences = _differences(arms, engine, len(minutes))
            if differences:
                lines += [f"difference from TRL in {engine} (paired by seed):", "",
                          table(["arm", "seeds", *(f"{m:g} min" for m in minutes)], differences), ""]
        rows = []
        for arm, runs in arms.items():
            seconds = {k: statistics.fmean(r["seconds"][k] for r in runs.values()) for k in SECONDS}
            steps = [statistics.fmean(r["steps_by_mark"][i] for r in runs.values()) for i in range(len(config.marks))]
            rows.append([ARMS[arm][0], len(runs), statistics.fmean(r["setup_s"] for r in runs.values()),
                         seconds["step_s"], seconds["generation_s"], seconds["update_s"], seconds["sync_s"],
                         " / ".join(f"{s:.1f}" for s in steps)])
        lines += ["steps and seconds (means over seeds of each run's median step):", "",
                  table(["arm", "seeds", "start-up s", "s/step", "generation s", "update s", "sync s",
                         "steps done by " + " / ".join(f"{m / 60:g}" for m in config.marks) + " min"], rows), ""]
    return "\n".join(lines)


def _scored(runs: dict[int, Any], engine: str) -> list[list[float]]:
    """The pass@1 series (minute 0, then each mark) of the runs scored in `engine`."""
    return [r["pass@1"][engine] for r in runs.values() if r["pass@1"][engine] is not None]


def _cell(estimate: tuple[float, float]) -> str:
    mean, half = estimate
    return f"{mean:.3f}" if half != half else f"{mean:.3f} ± {half:.3f}"


def _differences(arms: dict[str, Any], engine: str, points: int) -> list[list]:
    if "trl" not in arms:
        return []
    rows = []
    for arm, runs in arms.items():
        if arm == "trl":
            continue
        pairs = [(runs[s]["pass@1"][engine], arms["trl"][s]["pass@1"][engine]) for s in runs
                 if s in arms["trl"] and runs[s]["pass@1"][engine] and arms["trl"][s]["pass@1"][engine]]
        if pairs:
            rows.append([ARMS[arm][0], len(pairs),
                         *(_cell(interval([a[i] - b[i] for a, b in pairs])) for i in range(points))])
    return rows


def plot(config: VsTrlConfig, results: dict[str, Any], folder: Path) -> list[Path]:
    """One PNG per task: pass@1 against wall minutes, a panel per engine, mean and 95% band per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    minutes = [0.0, *(m / 60 for m in config.marks)]
    written = []
    for task, arms in results.items():
        figure, axes = plt.subplots(1, len(config.eval_engines), figsize=(5.5 * len(config.eval_engines), 4),
                                    squeeze=False)
        for axis, engine in zip(axes[0], config.eval_engines):
            for arm, runs in arms.items():
                scored = _scored(runs, engine)
                if not scored:
                    continue
                points = [interval([s[i] for s in scored]) for i in range(len(minutes))]
                means = [p[0] for p in points]
                halves = [0.0 if p[1] != p[1] else p[1] for p in points]
                axis.plot(minutes, means, marker="o", label=f"{ARMS[arm][0]} ({len(scored)} seeds)")
                axis.fill_between(minutes, [m - h for m, h in zip(means, halves)],
                                  [m + h for m, h in zip(means, halves)], alpha=0.2)
            axis.set(title=f"{task}: pass@1 in {engine}", xlabel="wall minutes of training", ylabel="pass@1")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
        figure.tight_layout()
        path = folder / f"{task}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def parse_args(argv: list[str] | None) -> tuple[VsTrlConfig, list[str]]:
    command_line = CommandLine(
        "deployrl bench vs-trl", VsTrlConfig,
        "deployrl against TRL's GRPOTrainer at equal wall time, scored in the deployed engine: for each task,"
        " seed and arm (TRL with LoRA; deployrl as shipped; deployrl with TRL's engine hf:fp32, first task"
        " only) one training run with the same wall-clock budget, one at a time, keeping the adapter at"
        " fixed minutes; then every kept adapter scored on held-out problems in llama.cpp Q4_1 (the deployed"
        " engine) and fp32 transformers; then a report with means and 95% intervals over seeds"
        " (docs/benchmarks.md). Resumes what --out holds. Needs TRL: pip install 'deployrl[bench]'.",
        FLAGS, train_items=("key=value", "deployrl train config overrides for every arm and task"),
    )
    return parse_with_overrides(command_line, argv)


def main(argv: list[str] | None = None) -> int:
    config, overrides = parse_args(argv)
    from deployrl.settings.config import load_config
    from deployrl.settings.parsing import ConfigError

    if importlib.util.find_spec("trl") is None and "trl" in config.arms and not config.report:
        print("deployrl bench vs-trl: error: the trl arm needs TRL: pip install 'deployrl[bench]'", file=sys.stderr)
        return 2
    out, overrides = Path(config.out), [*overrides, f"model.name={config.model}"]
    try:  # every run's settings, before anything trains
        for task, arm, _ in config.runs():
            load_config(None, [*TASKS[task][1], *overrides, *ARMS[arm][2]])
        if not config.report:
            model_dir, is_gguf = hf_model_dir(config.model, Path(config.cache_dir) if config.cache_dir
                                              else default_cache_dir())
            if not is_gguf:
                raise ValueError(f"--model {config.model}: the deployed engine (llama.cpp) needs a GGUF model")
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"deployrl bench vs-trl: error: {err}", file=sys.stderr)
        return 2
    hardware, _, versions = environment(0, True)
    header = [hardware, versions, f"- settings: {config.budget_min:g} min per run, adapters kept at "
              + ", ".join(f"{m / 60:g}" for m in config.marks) + f" min; seeds {list(config.seeds)};"
              f" overrides {overrides}"]
    if not config.report:
        out.mkdir(parents=True, exist_ok=True)
        train_all(config, overrides, model_dir)
        score_all(config, overrides)
    results = collect(config)
    text = report(config, results, header)
    (out / "report.md").write_text(text + "\n")
    _write_json(out / "results.json", {"environment": header, "marks": config.marks, "results": results})
    plot(config, results, out / "plots")
    print(text)
    return 0
