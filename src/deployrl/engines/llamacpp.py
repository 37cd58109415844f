"""The `llamacpp` engine: sampling in llama.cpp (llama-cpp-python) from a GGUF file.

llama.cpp computes the logits with its own kernels on the GGUF weights (F32, F16, BF16, Q8_0,
Q4_0, Q4_1): the engine a user deploys on a CPU. deployrl's shared sampler draws from those
logits, so `logp_inf` is exactly the log-probability of the distribution sampled from.

`sync` re-encodes the trainer's weights into a GGUF of the engine's type (`gguf_io`), then
reloads llama.cpp through `LlamaRuntime` (no AMX kernels, see llama_runtime.py). A model with
LoRA adapters (`model.lora`) keeps its base GGUF loaded: each sync writes the adapters as a GGUF
LoRA adapter (`adapter_scales`: alpha / r per adapted layer) and swaps it in.

Generation is batched: each prompt is evaluated once into one sequence of a unified KV cache
and shared with its other completions (`copy_sequence`, no data copied); then every
`llama_decode` call advances up to `parallel` completions, of one prompt or several, by one
token. Each completion draws with its own generator, so the tokens do not depend on which
completions were decoded together (`parallel=1` decodes one completion at a time).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, pad_rollouts
from deployrl.engines.gguf_io import FILE_TYPES, FLOAT_TYPES, GGUFTemplate, write_gguf, write_gguf_adapter
from deployrl.engines.llama_runtime import LlamaRuntime
from deployrl.engines.sampling import sample_next
from deployrl.lora import split_adapter
from deployrl.registry import unknown_name_error

CACHE_GRANULE = 256  # KV cells are allocated in multiples of this, so small changes reuse the context


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
        threads: Optional[int] = None,
        parallel: int = 32,
        adapter_scales: Optional[dict[str, float]] = None,
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
        self.template = GGUFTemplate.read(Path(template))  # once: parsing its tokenizer takes seconds
        self.eos_token_ids = list(eos_token_ids)
        self.n_ctx = n_ctx
        self.threads = threads
        self.parallel = parallel
        self._dir = tempfile.TemporaryDirectory(prefix="deployrl-gguf-")
        self.path = Path(self._dir.name) / f"model.{file_type}.gguf"
        self.adapter_file = Path(self._dir.name) / "adapter.gguf"
        self.adapter_scales = dict(adapter_scales or {})
        self.adapter_path: Optional[Path] = None  # the adapter applied, once there is one
        self._quantised: Optional[dict[str, torch.Tensor]] = None
        self.runtime: Optional[LlamaRuntime] = None
        self.sync(state_dict)

    @property
    def context_length(self) -> int:
        return self.n_ctx

    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take the trainer's weights. With LoRA adapters (peft names) the base is frozen: it is
        written and loaded once, and each sync writes only the adapter file and swaps it in."""
        start = time.perf_counter()
        base, adapters = split_adapter(state_dict, self.adapter_scales)
        if self.runtime is None or not adapters:
            # a quantised file rounds the weights far more than float kernels do: keep what it holds
            # (a LoRA base is frozen on the file's own grid: nothing to keep)
            self._quantised = None if self.file_type in FLOAT_TYPES or adapters else {}
            write_gguf(base, self.config, self.template, self.path, self.file_type, held=self._quantised)
            self._load(self.runtime.n_ctx if self.runtime is not None else self.n_ctx)
        if adapters:
            self.adapter_path = write_gguf_adapter(adapters, self.config, self.template.arch, self.adapter_file)
            self.runtime.set_adapter(self.adapter_path)
        self.last_sync_s = time.perf_counter() - start

    def _load(self, cells: int) -> None:
        if self.runtime is not None:
            self.runtime.close()  # free the old model before loading the new one
        self.runtime = None
        self.runtime = LlamaRuntime(self.path, n_ctx=cells, n_seq=self.parallel, threads=self.threads)
        if self.adapter_path is not None:
            self.runtime.set_adapter(self.adapter_path)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        return self.runtime.score(token_ids)

    def take_quantised_weights(self) -> Optional[dict[str, torch.Tensor]]:
        quantised, self._quantised = self._quantised, None
        return quantised

    def _cache_cells(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """KV cells for `parallel` completions running together: their prompts once each (when
        completions start in order, ceil(parallel / K) + 1 prompts), plus max_new_tokens per
        completion. Stragglers of more prompts fit or wait: a row starts only if its cells are free."""
        longest, k, new = max(len(p) for p in prompts), params.n, params.max_new_tokens
        rows = min(self.parallel, len(prompts) * k)
        cells = min(len(prompts), math.ceil(rows / k) + 1) * longest + rows * new
        return max(cells, self.n_ctx)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        self.check_prompts(prompts, params)
        start = time.perf_counter()
        cells = self._cache_cells(prompts, params)
        if cells > self.runtime.n_ctx or self.parallel > self.runtime.n_seq:  # `parallel` may have been raised
            self._load(max(math.ceil(cells / CACHE_GRANULE) * CACHE_GRANULE, self.runtime.n_ctx))
        completions, logps, finish, stats = self._decode_all(prompts, params)
        elapsed = time.perf_counter() - start
        total = sum(len(c) for c in completions)
        timing = {"generate_s": elapsed, "tokens": float(total), "tokens_per_s": total / max(elapsed, 1e-9)}
        rows = [prompt for prompt in prompts for _ in range(params.n)]
        stacked = [{name: torch.stack([step[name] for step in row]) for name in row[0]} if row else {} for row in stats]
        return pad_rollouts(rows, completions, logps, finish, self.semantics, params.n, timing, stacked)

    def _decode_all(self, prompts: list[list[int]], params: SamplingParams):
        """Continuous batching over the P*K completions (rows p*K + k).

        A row starts when a sequence and its KV cells are free: in a sequence that already holds
        its prompt (a finished row of the same prompt, cut back to the prompt), in a copy of the
        prompt from a running row, or, for a prompt's first row, by evaluating the prompt.
        """
        runtime, k, budget = self.runtime, params.n, params.max_new_tokens
        runtime.clear()
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        generators = params.completion_generators(len(prompts))
        completions = [[] for _ in generators]
        logps = [[] for _ in generators]
        stats: list[list[dict[str, torch.Tensor]]] = [[] for _ in generators]  # per row, per token (top_m > 0)
        finish = ["length"] * len(generators)
        waiting = deque(range(len(generators)))
        free_seqs = list(range(runtime.n_seq - 1, -1, -1))
        seq_of: dict[int, int] = {}  # running row -> its sequence
        logits: dict[int, torch.Tensor] = {}  # running row -> logits of its next token
        holders: dict[int, set[int]] = {}  # prompt -> sequences holding its cells
        source: dict[int, int] = {}  # prompt -> one sequence that holds them already (to copy from)
        idle: dict[int, int] = {}  # prompt -> a sequence holding the prompt only
        prompt_logits: dict[int, torch.Tensor] = {}
        cells_used = 0

        while waiting or seq_of:
            started, to_evaluate = [], []
            while waiting and len(seq_of) < self.parallel:
                row = waiting[0]
                prompt = row // k
                cells = budget + (0 if prompt in holders else len(prompts[prompt]))
                if cells_used + cells > runtime.n_ctx or (prompt not in idle and not free_seqs):
                    break
                waiting.popleft()
                cells_used += cells
                if prompt in idle:
                    seq = idle.pop(prompt)
                else:
                    seq = free_seqs.pop()
                    if prompt not in holders:
                        to_evaluate.append((prompt, seq))
                        holders[prompt] = set()
                    started.append((prompt, seq))
                holders[prompt].add(seq)
                seq_of[row] = seq
            if to_evaluate:
                tokens, positions, seqs, outputs = [], [], [], []
                for prompt, seq in to_evaluate:
                    ids = prompts[prompt]
                    tokens += ids
                    positions += range(len(ids))
                    seqs += [seq] * len(ids)
                    outputs += [False] * (len(ids) - 1) + [True]
                for (prompt, seq), row_logits in zip(to_evaluate, runtime.decode(tokens, positions, seqs, outputs)):
                    prompt_logits[prompt] = row_logits
                    source[prompt] = seq
            for prompt, seq in started:
                if source[prompt] != seq:
                    runtime.copy_sequence(source[prompt], seq, until=len(prompts[prompt]))
            for row in seq_of:
                if row not in logits:
                    logits[row] = prompt_logits[row // k]

            rows = list(seq_of)
            draw = sample_next(torch.stack([logits.pop(r) for r in rows]), params.view, [generators[r] for r in rows],
                               self.semantics, params.top_m)
            values = draw.logp
            entries = []
            for i, (row, token, value) in enumerate(zip(rows, draw.tokens.tolist(), values.tolist())):
                completions[row].append(token)
                logps[row].append(value)
                if draw.stats:
                    stats[row].append({name: stat[i] for name, stat in draw.stats.items()})
                prompt, length = row // k, len(prompts[row // k])
                if token in stop_ids or len(completions[row]) == budget:
                    finish[row] = "stop" if token in stop_ids else "length"
                    seq = seq_of.pop(row)
                    cells_used -= budget
                    more_rows = bool(waiting) and waiting[0] // k == prompt
                    if more_rows and prompt not in idle:
                        runtime.drop_sequence(seq, start=length)
                        idle[prompt] = seq
                        continue
                    runtime.drop_sequence(seq)
                    holders[prompt].discard(seq)
                    free_seqs.append(seq)
                    if not holders[prompt]:
                        del holders[prompt], prompt_logits[prompt], source[prompt]
                        cells_used -= length
                    elif source[prompt] == seq:
                        source[prompt] = next(iter(holders[prompt]))
                else:
                    entries.append((row, token, length + len(completions[row]) - 1))
            if entries:
                new_logits = runtime.decode(
                    [token for _, token, _ in entries], [pos for _, _, pos in entries],
                    [seq_of[row] for row, _, _ in entries], [True] * len(entries),
                )
                logits.update(zip((row for row, _, _ in entries), new_logits))
        return completions, logps, finish, stats
