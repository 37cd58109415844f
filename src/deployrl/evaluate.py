"""Evaluation in the deployment engine: pass@1, avg@k and pass@k on a task or benchmark.

With k samples per problem and c correct, avg@k = c / k (the unbiased estimate of pass@1
at the sampling temperature) and pass@k = 1 if c > 0 (Chen et al. 2021's estimator at n = k).
Greedy decoding is `top_k=1`. The reward is the task's own, so training and evaluation
cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deployrl.engines.base import SamplingParams
from deployrl.prompts import encode_prompts
from deployrl.rewards import score_completions


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
    avg = sum(sum(c) / len(c) for c in correct) / len(correct)
    return {
        "pass@1": avg,
        f"avg@{cfg.samples}": avg,
        f"pass@{cfg.samples}": sum(any(c) for c in correct) / len(correct),
        "mean_reward": sum(scores.values) / len(scores.values),
        "mean_length": float(batch.lengths.float().mean()),
        "problems": float(len(examples)),
        "reward_failures": float(scores.failures + scores.timeouts),
    }


def main(argv: list[str] | None = None) -> int:
    from deployrl.config import EvalConfig
    from deployrl.engines import make_engine, parse_engine_spec
    from deployrl.engines.check import verify_engine
    from deployrl.models import end_token_ids, load_model, load_tokenizer, resolve_model
    from deployrl.tasks import TaskConfig, load_task

    parser = argparse.ArgumentParser(
        prog="deployrl eval",
        description="Score a model or checkpoint on a task or benchmark, sampling in a deployment engine.",
    )
    parser.add_argument("--model", default="smollm2-135m",
                        help="model directory (e.g. a checkpoint's model/ folder or an export), .gguf file, or alias")
    parser.add_argument("--gguf-template", default=None,
                        help="GGUF whose tokenizer/metadata a llamacpp engine reuses (default: the model's own GGUF, else smollm2-135m's)")
    parser.add_argument("--engine", default="llamacpp:q4_1", help="engine spec, e.g. llamacpp:q4_1 or hf:bf16")
    parser.add_argument("--benchmark", default=None,
                        help="math500, aime24, aime25, amc23, minerva_math, olympiadbench or gsm8k")
    parser.add_argument("--task", default=None, help="reasoning-gym dataset name (when no --benchmark)")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--samples", type=int, default=1, help="completions per problem (k)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true", help="top-k 1 sampling")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the scores as JSON")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")

    try:  # every argument, the data and the model's files are checked before the model loads
        parse_engine_spec(args.engine)
        if args.benchmark:
            task_cfg = TaskConfig(type="benchmark", name=args.benchmark)
        else:
            task_cfg = TaskConfig(type="reasoning_gym", name=args.task or "basic_arithmetic", seed=args.seed + 1)
        cfg = EvalConfig(num_prompts=args.num_prompts, samples=args.samples, temperature=args.temperature,
                         top_k=1 if args.greedy else 0, max_new_tokens=args.max_new_tokens)
        task = load_task(task_cfg)
        source = resolve_model(args.model)
        # a llamacpp engine writes the weights into a GGUF shaped like a template's
        engine_source = source
        if args.gguf_template or (source.gguf_file is None and args.engine.startswith("llamacpp")):
            engine_source = resolve_model(args.gguf_template or "smollm2-135m")
        tokenizer = load_tokenizer(source)
    except (ValueError, FileNotFoundError) as err:  # bad input: its message, not a traceback
        parser.exit(2, f"deployrl eval: error: {err}\n")
    model = load_model(source).eval()
    engine = make_engine(args.engine, model, engine_source, end_token_ids(tokenizer, model))
    verify_engine(engine, model, tokenizer)
    scores = evaluate(engine, tokenizer, task, cfg, args.max_new_tokens, args.seed)
    print(f"{task.name} with {args.model} in {args.engine}: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) and v < 10 else f"{k} {v:g}" for k, v in scores.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"task": task.name, "model": args.model, "engine": args.engine, **scores}, indent=2))
    return 0
