"""The `hf` engine: PyTorch generation with its own copy of the weights in a deployment precision.

Precisions: ``fp32``, ``bf16``, ``fp16``, and ``fp8``: every linear layer of the decoder
blocks stores its weight as float8_e4m3fn with one scale per output channel
(scale = max|W_row| / 448). On GPUs with FP8 units (compute capability 8.9+) it multiplies
with ``torch._scaled_mm`` on activations quantised per token the same way (W8A8, as FP8
serving engines do); elsewhere it dequantises the weight into bf16 for each matmul (W8A16):
torch's CPU ``_scaled_mm`` runs, but measured here it is 2.5x slower than dequantising.
Embeddings, norms and the output head stay in bf16, as in the FP8 checkpoints of vLLM.

Sampling is deployrl's own loop over a KV cache, with the shared sampler, so the reported
log-probabilities are exactly those of the distribution sampled from.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from torch import nn

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, Timing, pad_rollouts
from deployrl.engines.sampling import sample_next
from deployrl.models.formats import quantize_fp8
from deployrl.models.loading import cache_argument, checkpointing_name, is_checkpointing
from deployrl.models.lora import is_adapter_name
from deployrl.registry import unknown_name_error

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class FP8Linear(nn.Module):
    """A linear layer with a float8_e4m3fn weight and per-output-channel scales."""

    def __init__(self, linear: nn.Linear, scaled_mm: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.scaled_mm = scaled_mm
        weight, scale = quantize_fp8(linear.weight)
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("scale", scale[:, 0])
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Accept the trainer's float weights (HF names) and re-quantise them.
        if prefix + "weight" not in state_dict:
            missing_keys.append(prefix + "weight")
            return
        weight, scale = quantize_fp8(state_dict[prefix + "weight"])
        self.weight_fp8.copy_(weight)
        self.scale.copy_(scale[:, 0])
        if self.bias is not None:
            self.bias.copy_(state_dict[prefix + "bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [N, K]
        if self.scaled_mm:
            x8, x_scale = quantize_fp8(flat)
            out = torch._scaled_mm(
                x8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.scale[None, :], out_dtype=torch.bfloat16
            )
        else:
            weight = self.weight_fp8.to(torch.bfloat16) * self.scale[:, None].to(torch.bfloat16)
            out = flat.to(torch.bfloat16) @ weight.t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def scaled_mm_runs(device: torch.device) -> bool:
    """Whether this device has FP8 matmul units and torch._scaled_mm with row-wise scales runs."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        a, _ = quantize_fp8(torch.randn(16, 32, device=device))
        b, _ = quantize_fp8(torch.randn(16, 32, device=device))
        torch._scaled_mm(
            a, b.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
            out_dtype=torch.bfloat16,
        )
        return True
    except (RuntimeError, NotImplementedError):
        return False


def to_fp8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear except the output head and LoRA adapters by an FP8Linear (in place)."""
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    use_scaled_mm = scaled_mm_runs(device)
    if device.type == "cuda" and not use_scaled_mm:
        warnings.warn("no FP8 matmul on this GPU: the fp8 engine dequantises its weights (W8A16)")
    for name, module in list(model.named_modules()):
        if is_adapter_name(name):  # LoRA adapters keep the engine's compute precision (bf16)
            continue
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child is not head:
                setattr(module, child_name, FP8Linear(child, use_scaled_mm))
    return model


class HFEngine(RolloutEngine):
    """PyTorch generation in a deployment precision, from a copy of the trainer's model."""

    def __init__(self, model: nn.Module, precision: str, eos_token_ids: list[int], max_context: int | None = None):
        if precision not in PRECISIONS:
            raise unknown_name_error("hf engine precision", precision, list(PRECISIONS))
        self.name = f"hf:{precision}"
        self.precision = precision
        self.eos_token_ids = list(eos_token_ids)
        engine_model = copy.deepcopy(model).to(PRECISIONS[precision]).eval().requires_grad_(False)
        if is_checkpointing(engine_model):
            getattr(engine_model, f"{checkpointing_name(engine_model)}_checkpointing_disable")()
        self.model = to_fp8(engine_model) if precision == "fp8" else engine_model
        self._context = max_context or getattr(model.config, "max_position_embeddings", 2048)

    @property
    def context_length(self) -> int:
        return self._context

    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=next(self.model.parameters()).device)
        logits = self.model(input_ids=ids).logits[0, :-1].float()  # [len - 1, V]: one short sequence
        return logits.log_softmax(dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        self.check_prompts(prompts, params)
        start = time.perf_counter()
        device = next(self.model.parameters()).device
        rows = [p for p in prompts for _ in range(params.n)]  # group-major
        width = max(len(p) for p in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for b, prompt in enumerate(rows):  # left padding: every row's last token is at the end
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            attention[b, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        generators = params.prompt_generators(len(prompts), device)
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), device=device)
        view = params.view

        tokens, logps, stats = [], [], []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=device)
        cache, cache_name = None, cache_argument(self.model)
        for _ in range(params.max_new_tokens):
            out = self.model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions,
                use_cache=True, logits_to_keep=1, **{cache_name: cache},
            )
            cache = out[cache_name]
            draw = sample_next(out.logits[:, -1], view, generators, self.semantics, params.top_m)
            tokens.append(draw.tokens)
            logps.append(draw.logp)
            stats.append(draw.stats)
            lengths += (~finished).long()
            finished |= torch.isin(draw.tokens, stop_ids)
            if finished.all():
                break
            input_ids = draw.tokens[:, None]
            attention = torch.cat([attention, torch.ones_like(input_ids)], dim=1)
            positions = positions[:, -1:] + 1

        all_tokens = torch.stack(tokens, dim=1).cpu()  # [B, steps]
        all_logps = torch.stack(logps, dim=1).float().cpu()
        all_stats = {name: torch.stack([step[name] for step in stats], dim=1).cpu() for name in stats[0]}  # [B, steps, ...]
        lengths = lengths.cpu().tolist()
        finish = ["stop" if f else "length" for f in finished.cpu().tolist()]
        return pad_rollouts(
            rows,
            [all_tokens[b, :n].tolist() for b, n in enumerate(lengths)],
            [all_logps[b, :n].tolist() for b, n in enumerate(lengths)],
            finish,
            self.semantics,
            params.n,
            Timing.since(start, sum(lengths)),
            [{name: value[b, :n] for name, value in all_stats.items()} for b, n in enumerate(lengths)],
        )
