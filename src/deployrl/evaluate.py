"""Evaluation in the deployment engine: pass@1, avg@k and pass@k on a task or benchmark.

With k samples per problem and c correct, avg@k = c / k (the unbiased estimate of pass@1
at the sampling temperature) and pass@k = 1 if c > 0 (Chen et al. 2021's estimator at n = k);
pass@1_se is the standard error of pass@1 over problems (sample standard deviation / √n).
Greedy decoding is `top_k=1`. The reward is the task's own, so training and evaluation
cannot drift apart. A LoRA adapter folder is scored on its base model, with the engine applying the
adapter as it does during training (llama.cpp: the base GGUF plus a GGUF LoRA adapter).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from deployrl.algo._checks import check_positive
from deployrl.config import EvalSettings, default_task
from deployrl.configcli import CommandLine, Flag
from deployrl.configdoc import setting
from deployrl.engines import engine_help, engine_kind, parse_engine_spec
from deployrl.engines.base import SamplingParams
from deployrl.prompts import encode_prompts
from deployrl.reward_sandbox import score_completions
from deployrl.task_settings import TaskConfig
from deployrl.tasks import load_task


@dataclass(frozen=True)
class EvalCommandConfig(EvalSettings):
    """`deployrl eval`: a model, the engine that samples it, and what a run's `eval` section sets."""

    num_prompts: int = 50
    max_new_tokens: int = setting(512, "the longest completion")
    task: TaskConfig = setting(help="the task scored (docs/tasks.md); default: the default run's task with seed 1,"
                                    " other problems than a default run trained on (its held-out set)",
                               factory=lambda: replace(default_task(), seed=1))
    model: str = setting("smollm2-135m", "model directory (e.g. a checkpoint's model/ folder or an export), .gguf file,"
                                         " alias, or a LoRA adapter folder (peft layout: a LoRA run's checkpoint"
                                         " model/ or export adapter/)")
    base: Optional[str] = setting(None, "an adapter's base model; None: the one its adapter_config.json names")
    gguf_template: Optional[str] = setting(None, "GGUF whose tokenizer/metadata an engine that needs a GGUF reuses;"
                                                 " None: the model's own GGUF, else smollm2-135m's")
    engine: str = setting("llamacpp:q4_1", lambda: f"the engine that samples, {engine_help()}")
    seed: int = setting(0, "the sampling seed")
    json: Optional[str] = setting(None, "also write the scores as JSON to this path")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("num_prompts", self.num_prompts)
        parse_engine_spec(self.engine)


FLAGS = (
    Flag("--model", "model"),
    Flag("--base", "base"),
    Flag("--gguf-template", "gguf_template"),
    Flag("--engine", "engine"),
    Flag("--task", "task.name", "a reasoning-gym dataset, with its own default settings",
         also=(("task.type", "reasoning_gym"), ("task.rg_config", {}), ("task.instruction", None))),
    Flag("--benchmark", "task.name", "math500, aime24, aime25, amc23, minerva_math, olympiadbench or gsm8k",
         also=(("task.type", "benchmark"),)),
    Flag("--num-prompts", "num_prompts"),
    Flag("--samples", "samples"),
    Flag("--temperature", "temperature"),
    Flag("--greedy", "top_k", "greedy decoding", const=1),
    Flag("--max-new-tokens", "max_new_tokens"),
    Flag("--seed", "seed"),
    Flag("--json", "json"),
)


COMMAND_LINE = CommandLine(
    "deployrl eval", EvalCommandConfig,
    "Score a model or checkpoint on a task or benchmark, sampling in a deployment engine. Settings are the"
    " keys of a training run's eval section (task, num_prompts, samples, temperature, top_k, max_new_tokens)"
    " plus model, gguf_template, engine, seed and json.",
    FLAGS,
)


def evaluate(engine, tokenizer, task, cfg, max_new_tokens: int, seed: int = 0) -> dict[str, float]:
    """Score the first cfg.num_prompts problems of `task` with cfg.samples completions each."""
    examples = task.examples[: cfg.num_prompts]
    if not examples:
        raise ValueError(f"task {task.name} has no examples to evaluate")
    params = SamplingParams(
        n=cfg.samples, temperature=cfg.temperature, top_k=cfg.top_k, max_new_tokens=max_new_tokens, seed=seed
    )
    batch = engine.generate(encode_prompts(tokenizer, [e.prompt for e in examples]), params)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in batch.completions()]
    references = [examples[row // cfg.samples].reference for row in range(len(texts))]
    scores = score_completions(task.reward, texts, references)
    correct = [
        [v >= 1.0 for v in scores.values[i * cfg.samples:(i + 1) * cfg.samples]] for i in range(len(examples))
    ]
    per_problem = [sum(c) / len(c) for c in correct]
    avg = statistics.fmean(per_problem)
    return {
        "pass@1": avg,
        # the standard error over problems
        "pass@1_se": statistics.stdev(per_problem) / math.sqrt(len(per_problem)) if len(per_problem) > 1 else 0.0,
        f"avg@{cfg.samples}": avg,
        f"pass@{cfg.samples}": sum(any(c) for c in correct) / len(correct),
        "mean_reward": sum(scores.values) / len(scores.values),
        "mean_length": float(batch.lengths.float().mean()),
        "problems": float(len(examples)),
        "reward_failures": float(scores.failures + scores.timeouts),
    }


def main(argv: list[str] | None = None) -> int:
    from deployrl.engines import make_engine
    from deployrl.engines.check import verify_engine
    from deployrl.lora import ADAPTER_CONFIG, adapter_base, attach_adapter
    from deployrl.models import end_token_ids, load_model, load_tokenizer, resolve_model

    config, _ = COMMAND_LINE.parse(argv)
    try:  # the data and the model's files are checked before the model loads
        task = load_task(config.task)
        adapter = Path(config.model) if (Path(config.model) / ADAPTER_CONFIG).is_file() else None
        source = resolve_model(adapter_base(adapter, config.base) if adapter else config.model)
        # a llamacpp engine writes the weights into a GGUF shaped like a template's
        engine_source = source
        if config.gguf_template or (source.gguf_file is None and engine_kind(config.engine).needs_gguf):
            engine_source = resolve_model(config.gguf_template or "smollm2-135m")
        tokenizer = load_tokenizer(source)
    except (ValueError, FileNotFoundError) as err:
        COMMAND_LINE.fail(err)
    model = load_model(source).eval()
    if adapter is not None:  # the engine applies the adapter on the base, as in training
        attach_adapter(model, adapter)
    engine = make_engine(config.engine, model, engine_source, end_token_ids(tokenizer, model))
    verify_engine(engine, model, tokenizer)
    scores = evaluate(engine, tokenizer, task, config, config.max_new_tokens, config.seed)
    print(f"{task.name} with {config.model} in {config.engine}: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) and v < 10 else f"{k} {v:g}" for k, v in scores.items()))
    if config.json:
        Path(config.json).write_text(
            json.dumps({"task": task.name, "model": config.model, "engine": config.engine, **scores}, indent=2)
        )
    return 0
