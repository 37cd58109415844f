"""Evaluation in the deployment engine: pass@1, avg@k and pass@k on a task or benchmark.

With k samples per problem and c correct, avg@k = c / k (the unbiased estimate of pass@1
at the sampling temperature) and pass@k = 1 if c > 0 (Chen et al. 2021's estimator at n = k);
pass@1_se is the standard error of pass@1 over problems (sample standard deviation / √n).
Greedy decoding is `top_k=1`. The reward is the task's own, so training and evaluation
cannot drift apart. A LoRA adapter folder is scored on its base model, with the engine applying the
adapter as it does during training (llama.cpp: the base GGUF plus a GGUF LoRA adapter).
"""

from __future__ import annotations

import math
import statistics

from deployrl.engines.base import SamplingParams
from deployrl.rewards.sandbox import score_completions
from deployrl.tasks.prompts import encode_prompts


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
