"""`deployrl eval`: score a model or checkpoint on a task or benchmark in a deployment engine.

The scores are `deployrl.training.evaluation.evaluate`'s (pass@1, avg@k, pass@k); this module is
the command's settings and the model and engine it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from deployrl.algo._checks import check_positive
from deployrl.engines import engine_help, engine_kind, parse_engine_spec
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.config import EvalSettings, default_task
from deployrl.settings.docs import setting
from deployrl.settings.task import TaskConfig
from deployrl.tasks import load_task
from deployrl.training.evaluation import evaluate


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


def score_in_engine(engine_spec: str, model, engine_source, tokenizer, task, config: EvalCommandConfig) -> dict:
    """`config`'s scores of `model` on `task`, sampled by a fresh `engine_spec` engine (its kernel
    self-check passed first; closed afterwards)."""
    from deployrl.engines import make_engine
    from deployrl.engines.check import verify_engine
    from deployrl.models.loading import end_token_ids

    engine = make_engine(engine_spec, model, engine_source, end_token_ids(tokenizer, model))
    try:
        verify_engine(engine, model, tokenizer)
        return evaluate(engine, tokenizer, task, config, config.max_new_tokens, config.seed)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    from deployrl.models.loading import gguf_read_once

    config, _ = COMMAND_LINE.parse(argv)
    with gguf_read_once():  # the checks, the model and the engine share one parse of a GGUF
        return score_and_report(config)


def score_and_report(config: EvalCommandConfig) -> int:
    from deployrl.models.loading import load_model, load_tokenizer, resolve_model
    from deployrl.models.lora import ADAPTER_CONFIG, adapter_base, attach_adapter

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
    scores = score_in_engine(config.engine, model, engine_source, tokenizer, task, config)
    print(f"{task.name} with {config.model} in {config.engine}: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) and v < 10 else f"{k} {v:g}" for k, v in scores.items()))
    if config.json:
        Path(config.json).write_text(
            json.dumps({"task": task.name, "model": config.model, "engine": config.engine, **scores}, indent=2)
        )
    return 0
