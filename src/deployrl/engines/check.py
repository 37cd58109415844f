"""The kernel self-check: an engine must compute the trainer's model, up to its precision.

When an engine starts and after each weight sync, the engine and the trainer score one fixed
short chat sequence; the mean |log p_engine - log p_trainer| over its tokens must stay under the
bound of the engine's precision. The bounds are ~10x the gaps measured on SmolLM2-135M, with
its shipped weights and with weights moved off the quantisation grid as training moves them
(docs/engines.md has the table), so a correct engine passes with a wide margin while a broken
kernel (garbage logits: gaps of several nats) stops the run before any training step, instead
of turning into "discrepancy" for DC-GRPO to fight. For a quantised file the trainer scores with
the weights the file holds (`reference_on`), so that the rounding of drifting weights is not
counted as a kernel error. A trainer that computes on the engine's weights (`model.match_engine`)
is its own reference and is held to the tighter `MATCHED_GAP_BOUNDS`.
"""

from __future__ import annotations

import torch

from deployrl.models.loading import output_head, token_logprobs

CHECK_TEXT = (
    "<|im_start|>user\nWhat is 7 + 5? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
    "7 + 5 = 12. Seven plus five is twelve, so the answer is 12.<|im_end|>\n"
)

# mean |logp gap| allowed on CHECK_TEXT, per engine spec (measured gaps in docs/engines.md)
GAP_BOUNDS = {
    "hf:fp32": 0.1, "hf:bf16": 0.25, "hf:fp16": 0.25, "hf:fp8": 1.0,
    "llamacpp:f32": 0.1, "llamacpp:f16": 0.1, "llamacpp:bf16": 0.2,
    "llamacpp:q8_0": 0.5, "llamacpp:q4_1": 1.5, "llamacpp:q4_0": 2.0,
    "vllm:fp32": 0.1, "vllm:bf16": 0.3, "vllm:fp16": 0.1,
    "vllm:fp8": 1.5, "vllm:fp8_per_tensor": 1.5, "vllm:fp8_per_channel": 1.5, "vllm:fp8_per_block": 1.5,
}


# the bounds when the trainer computes on the engine's weights (model.match_engine): the rounding of
# the weights is no longer part of the gap, so what is left is the kernels' own (docs/engines.md)
MATCHED_GAP_BOUNDS = GAP_BOUNDS | {
    "llamacpp:q8_0": 0.4, "llamacpp:q4_1": 0.6, "llamacpp:q4_0": 0.6, "hf:fp8": 0.6, "vllm:fp8_per_channel": 0.8,
}


class KernelMismatch(RuntimeError):
    """An engine's log-probabilities are far from the trainer's: its kernels compute something else."""


def check_ids(tokenizer, vocab_size: int) -> list[int]:
    """CHECK_TEXT as token ids of the model (ids past a tiny test model's vocabulary wrap around)."""
    ids = tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"]
    return [i % vocab_size for i in ids]


@torch.no_grad()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) [len - 1] float32 under the trainer's model (or its Scorer), on the CPU."""
    completion = torch.tensor([ids[1:]])
    mask = torch.ones_like(completion, dtype=torch.bool)
    return token_logprobs(model, [ids[:1]], completion, mask).logp[0].float().cpu()


@torch.no_grad()
def reference_on(model, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """`reference_logprobs` of `model` computed with `weights` (HF names) in place of its own,
    which are put back afterwards (the tensors are swapped, not copied)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    own = {}
    try:
        for name, value in weights.items():
            own[name] = tensors[name].data
            tensors[name].data = value.to(own[name].dtype)
        return reference_logprobs(model, ids)
    finally:
        for name, data in own.items():
            tensors[name].data = data


def check_engine(engine, reference: torch.Tensor, ids: list[int], matched: bool = False) -> float:
    """The mean |logp| gap of `engine` against the trainer's `reference` on `ids`; KernelMismatch
    if it exceeds the engine's bound (`matched`: the reference computed on the engine's weights)."""
    scored = engine.score(ids).float().cpu()
    gap = float((scored - reference).abs().mean())
    bound = (MATCHED_GAP_BOUNDS if matched else GAP_BOUNDS)[engine.name]
    if not gap <= bound:  # also catches NaN
        raise KernelMismatch(
            f"engine {engine.name} fails its kernel self-check: on a fixed {len(ids)}-token sequence its"
            f" log-probabilities differ from the trainer's by {gap:.3f} on average, beyond the {bound} that"
            f" {engine.name} explains. Its kernels compute something else than the model (a broken CPU"
            " path, e.g. llama.cpp's AMX kernels on Q4_0/Q4_1), so training against it would fight garbage."
            " Way out: another engine or file type (rollout.engine=llamacpp:f16 or hf:bf16), and a bug"
            " report with the CPU flags (grep flags /proc/cpuinfo) and llama-cpp-python's version."
        )
    return gap


def verify_engine(engine, model, tokenizer) -> float:
    """The self-check of an engine built from `model` (evaluation, `mismatch`): its mean gap."""
    ids = check_ids(tokenizer, output_head(model).shape[0])
    return check_engine(engine, reference_logprobs(model, ids), ids)
