"""The `llamacpp` engine: sampling in llama.cpp (llama-cpp-python) from a GGUF file.

llama.cpp computes the logits with its own kernels on the GGUF weights (F32, F16, BF16, Q8_0,
Q4_0, Q4_1): the engine a user deploys on a CPU. deployrl's shared sampler draws from those
logits, so `logp_inf` is exactly the log-probability of the distribution sampled from.

`sync` re-encodes the trainer's weights into a GGUF of the engine's type (`gguf_io`), then
reloads llama.cpp. The K completions of a prompt reuse the prompt's KV cache.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, pad_rollouts
from deployrl.engines.gguf_io import FILE_TYPES, write_gguf
from deployrl.engines.sampling import sample_next
from deployrl.registry import unknown_name_error


class LlamaCppEngine(RolloutEngine):
    """llama.cpp on a GGUF written from the trainer's weights."""

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor],
        config,
        template: Path,
        file_type: str,
        eos_token_ids: list[int],
        n_ctx: int = 2048,
        n_threads: int | None = None,
    ) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as err:
            raise ImportError("the llamacpp engine needs llama-cpp-python: pip install 'deployrl[llamacpp]'") from err
        if file_type not in FILE_TYPES:
            raise unknown_name_error("llamacpp file type", file_type, list(FILE_TYPES))
        if not Path(template).is_file():
            raise FileNotFoundError(f"GGUF template not found: {template}")
        self.name = f"llamacpp:{file_type}"
        self.file_type = file_type
        self.config = config
        self.template = Path(template)
        self.eos_token_ids = list(eos_token_ids)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or os.cpu_count() or 1
        self._dir = tempfile.TemporaryDirectory(prefix="deployrl-gguf-")
        self.path = Path(self._dir.name) / f"model.{file_type}.gguf"
        self.llm = None
        self.sync(state_dict)

    @property
    def context_length(self) -> int:
        return self.n_ctx

    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        from llama_cpp import Llama

        start = time.perf_counter()
        write_gguf(state_dict, self.config, self.template, self.path, self.file_type)
        self.llm = None  # free the old model before loading the new one
        self.llm = Llama(
            model_path=str(self.path), n_ctx=self.n_ctx, n_threads=self.n_threads,
            n_threads_batch=self.n_threads, logits_all=False, verbose=False,
        )
        self.last_sync_s = time.perf_counter() - start

    def _last_logits(self) -> torch.Tensor:
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.llm.n_vocab(),))
        return torch.from_numpy(array.copy())

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        self.check_prompts(prompts, params)
        start = time.perf_counter()
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        view = params.view
        rows, completions, logps, finish = [], [], [], []
        for prompt, generator in zip(prompts, params.prompt_generators(len(prompts))):
            self.llm.reset()
            self.llm.eval(prompt)
            prompt_logits = self._last_logits()
            for _ in range(params.n):
                self.llm.n_tokens = len(prompt)  # drop the previous completion from the KV cache
                logits, tokens, values, reason = prompt_logits, [], [], "length"
                for _ in range(params.max_new_tokens):
                    draw = sample_next(logits[None], view, [generator])
                    token = int(draw.tokens[0])
                    tokens.append(token)
                    values.append(float(draw.logp_processed[0] if self.semantics == "processed" else draw.logp_raw[0]))
                    if token in stop_ids:
                        reason = "stop"
                        break
                    if len(tokens) == params.max_new_tokens:
                        break
                    self.llm.eval([token])
                    logits = self._last_logits()
                rows.append(prompt)
                completions.append(tokens)
                logps.append(values)
                finish.append(reason)
        elapsed = time.perf_counter() - start
        total = sum(len(c) for c in completions)
        timing = {"generate_s": elapsed, "tokens": float(total), "tokens_per_s": total / max(elapsed, 1e-9)}
        return pad_rollouts(rows, completions, logps, finish, self.semantics, params.n, timing)
