"""Every engine against the fp32 trainer on the embedded model, side by side in one run.

For each engine: build time, sync time (the trainer's weights re-cast or re-encoded and
reloaded), sampling speed, and the mean |p_old - p_inf| on its own samples -- once with the
weights as shipped (dequantised Q4_1, so a Q4_1 engine holds exactly the trainer's weights)
and once after a small perturbation of every matrix (2% of its std), which moves the weights
off the Q4_1 grid as training does.

    python benchmarks/engines.py [--engines hf:fp32,llamacpp:q4_1] [--prompts 8] [-n 2] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import time

import torch

from deployrl.commands.mismatch import discrepancy_report
from deployrl.engines import make_engine
from deployrl.engines.base import SamplingParams, trainer_view
from deployrl.models.loading import end_token_ids, load_model, load_tokenizer, resolve_model, token_logprobs
from deployrl.settings.config import default_task
from deployrl.tasks import load_task
from deployrl.tasks.prompts import encode_prompts

ENGINES = "hf:fp32,hf:bf16,hf:fp16,hf:fp8,llamacpp:f16,llamacpp:q8_0,llamacpp:q4_1"


def mean_delta(model, engine, prompt_ids, params) -> tuple[float, float]:
    batch = engine.generate(prompt_ids, params)
    with torch.no_grad():
        logp_old = token_logprobs(
            model, batch.prompt_ids, batch.completion_ids, batch.mask, trainer_view(batch.semantics, params)
        ).logp
    return discrepancy_report(logp_old, batch, 0.01)["diff"]["mean"], batch.timing["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=ENGINES)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    source = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(source)
    model = load_model(source).eval()
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in load_task(default_task()).examples[: args.prompts]])
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)
    shipped = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # by parameter, so a tied embedding and output head move together
        for i, (_, p) in enumerate(model.named_parameters()):
            if p.dim() == 2:
                p.add_(0.02 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    perturbed = {k: v.clone() for k, v in model.state_dict().items()}

    print(f"SmolLM2-135M, fp32 trainer, {args.prompts} prompts x {args.n} completions, up to {args.max_new_tokens} tokens, {torch.get_num_threads()} threads")
    header = f"{'engine':<15} {'build s':>8} {'sync s':>7} {'tokens/s':>9} {'|dp| shipped':>13} {'|dp| perturbed':>15}"
    print(header)
    print("-" * len(header))
    for spec in args.engines.split(","):
        model.load_state_dict(shipped)
        start = time.perf_counter()
        engine = make_engine(spec, model, source, end_token_ids(tokenizer, model))
        build = time.perf_counter() - start
        delta_shipped, speed = mean_delta(model, engine, prompt_ids, params)
        model.load_state_dict(perturbed)
        start = time.perf_counter()
        engine.sync(model.state_dict())
        sync = time.perf_counter() - start
        delta_perturbed, _ = mean_delta(model, engine, prompt_ids, params)
        print(f"{spec:<15} {build:>8.1f} {sync:>7.1f} {speed:>9.1f} {delta_shipped:>13.5f} {delta_perturbed:>15.5f}", flush=True)
        del engine


if __name__ == "__main__":
    main()
