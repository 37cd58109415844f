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

from deployrl.engines.base import RolloutBatch, RolloutEngine, SamplingParams, Timing, pad_rollouts
from deployrl.engines.gguf_io import FILE_TYPES, FLOAT_TYPES, GGUFTemplate, write_gguf, write_gguf_adapter
from deployrl.engines.llama_runtime import LlamaRuntime
from deployrl.engines.sampling import sample_next
from deployrl.models.lora import split_adapter
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

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = None

    @property
    def takes_base(self) -> bool:
        return self.runtime is None or not self.adapter_scales

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
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        decoded = ContinuousBatch(self.runtime, prompts, params, self.parallel, stop_ids, self.semantics).run()
        timing = Timing.since(start, sum(len(c) for c in decoded.completions))
        rows = [prompt for prompt in prompts for _ in range(params.n)]
        stacked = [{name: torch.stack([step[name] for step in row]) for name in row[0]} if row else {}
                   for row in decoded.stats]
        return pad_rollouts(rows, decoded.completions, decoded.logps, decoded.finish, self.semantics, params.n, timing,
                            stacked)


class ContinuousBatch:
    """Continuous batching of one `generate` call over its P*K completions (rows p*K + k).

    A row starts when a sequence and its KV cells are free: in a sequence that already holds
    its prompt (a finished row of the same prompt, cut back to the prompt), in a copy of the
    prompt from a running row, or, for a prompt's first row, by evaluating the prompt. Each step
    draws one token for every running row and decodes them in one `llama_decode` call.
    """

    def __init__(self, runtime: LlamaRuntime, prompts: list[list[int]], params: SamplingParams, parallel: int,
                 stop_ids: set[int], semantics: str) -> None:
        self.runtime, self.prompts, self.params, self.parallel = runtime, prompts, params, parallel
        self.stop_ids, self.semantics = stop_ids, semantics
        self.k, self.budget = params.n, params.max_new_tokens
        self.generators = params.completion_generators(len(prompts))
        rows = len(self.generators)
        self.completions: list[list[int]] = [[] for _ in range(rows)]
        self.logps: list[list[float]] = [[] for _ in range(rows)]
        self.stats: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(rows)]  # per row, per token (top_m > 0)
        self.finish = ["length"] * rows
        self.waiting = deque(range(rows))
        self.free_seqs = list(range(runtime.n_seq - 1, -1, -1))
        self.seq_of: dict[int, int] = {}  # running row -> its sequence
        self.logits: dict[int, torch.Tensor] = {}  # running row -> logits of its next token
        self.holders: dict[int, set[int]] = {}  # prompt -> sequences holding its cells
        self.source: dict[int, int] = {}  # prompt -> one sequence that holds them already (to copy from)
        self.idle: dict[int, int] = {}  # prompt -> a sequence holding the prompt only
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.cells_used = 0

    def run(self) -> "ContinuousBatch":
        """Decode every row to a stop token or `max_new_tokens`; the rows' tokens, log-probs,
        statistics and finish reasons are then in `completions`, `logps`, `stats`, `finish`."""
        self.runtime.clear()
        while self.waiting or self.seq_of:
            self._start_rows()
            self._advance(self._draw())
        return self

    def _start_rows(self) -> None:
        """Start the waiting rows that fit, evaluating or copying their prompts."""
        started, to_evaluate = [], []
        while self.waiting and len(self.seq_of) < self.parallel:
            row = self.waiting[0]
            prompt = row // self.k
            cells = self.budget + (0 if prompt in self.holders else len(self.prompts[prompt]))
            if self.cells_used + cells > self.runtime.n_ctx or (prompt not in self.idle and not self.free_seqs):
                break
            self.waiting.popleft()
            self.cells_used += cells
            if prompt in self.idle:
                seq = self.idle.pop(prompt)
            else:
                seq = self.free_seqs.pop()
                if prompt not in self.holders:
                    to_evaluate.append((prompt, seq))
                    self.holders[prompt] = set()
                started.append((prompt, seq))
            self.holders[prompt].add(seq)
            self.seq_of[row] = seq
        if to_evaluate:
            self._evaluate_prompts(to_evaluate)
        for prompt, seq in started:
            if self.source[prompt] != seq:
                self.runtime.copy_sequence(self.source[prompt], seq, until=len(self.prompts[prompt]))
        for row in self.seq_of:
            if row not in self.logits:
                self.logits[row] = self.prompt_logits[row // self.k]

    def _evaluate_prompts(self, to_evaluate: list[tuple[int, int]]) -> None:
        """Evaluate each (prompt, sequence) in one decode call, keeping the logits of its last token."""
        tokens, positions, seqs, outputs = [], [], [], []
        for prompt, seq in to_evaluate:
            ids = self.prompts[prompt]
            tokens += ids
            positions += range(len(ids))
            seqs += [seq] * len(ids)
            outputs += [False] * (len(ids) - 1) + [True]
        for (prompt, seq), row_logits in zip(to_evaluate, self.runtime.decode(tokens, positions, seqs, outputs)):
            self.prompt_logits[prompt] = row_logits
            self.source[prompt] = seq

    def _draw(self) -> list[tuple[int, int, int]]:
        """One token for every running row; (row, token, position) of the rows that go on."""
        rows = list(self.seq_of)
        draw = sample_next(torch.stack([self.logits.pop(r) for r in rows]), self.params.view,
                           [self.generators[r] for r in rows], self.semantics, self.params.top_m)
        going_on = []
        for i, (row, token, value) in enumerate(zip(rows, draw.tokens.tolist(), draw.logp.tolist())):
            self.completions[row].append(token)
            self.logps[row].append(value)
            if draw.stats:
                self.stats[row].append({name: stat[i] for name, stat in draw.stats.items()})
            if token in self.stop_ids or len(self.completions[row]) == self.budget:
                self._finish_row(row, "stop" if token in self.stop_ids else "length")
            else:
                going_on.append((row, token, len(self.prompts[row // self.k]) + len(self.completions[row]) - 1))
        return going_on

    def _finish_row(self, row: int, reason: str) -> None:
        """Free a finished row's sequence: kept with its prompt for the prompt's next row, else dropped."""
        self.finish[row] = reason
        prompt, length = row // self.k, len(self.prompts[row // self.k])
        seq = self.seq_of.pop(row)
        self.cells_used -= self.budget
        more_rows = bool(self.waiting) and self.waiting[0] // self.k == prompt
        if more_rows and prompt not in self.idle:
            self.runtime.drop_sequence(seq, start=length)
            self.idle[prompt] = seq
            return
        self.runtime.drop_sequence(seq)
        self.holders[prompt].discard(seq)
        self.free_seqs.append(seq)
        if not self.holders[prompt]:
            del self.holders[prompt], self.prompt_logits[prompt], self.source[prompt]
            self.cells_used -= length
        elif self.source[prompt] == seq:
            self.source[prompt] = next(iter(self.holders[prompt]))

    def _advance(self, entries: list[tuple[int, int, int]]) -> None:
        """Decode the new token of each (row, token, position) in one call: the logits of their next tokens."""
        if entries:
            new_logits = self.runtime.decode(
                [token for _, token, _ in entries], [pos for _, _, pos in entries],
                [self.seq_of[row] for row, _, _ in entries], [True] * len(entries),
            )
            self.logits.update(zip((row for row, _, _ in entries), new_logits))
