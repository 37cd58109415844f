"""The one way deployrl loads a GGUF into llama.cpp: `LlamaRuntime`, over llama.cpp's C API.

Every place that runs llama.cpp (the engine, evaluation, `mismatch`, exports, benchmarks) goes
through this constructor, so the choices below hold everywhere:

* **No AMX kernels.** llama.cpp's "extra buffer types" repack weights for special kernels; on
  CPUs that advertise AMX (Intel Sapphire Rapids and later) one of them is the AMX path, which
  crashes or returns garbage on Q4_0/Q4_1 (seen here: a segfault in ggml_backend_amx_mul_mat on
  the first decode). When the CPU flags say AMX, the extra buffers are turned off
  (`use_extra_bufts = False`); elsewhere they stay on (the AVX2 repack of Q4_0 / Q8_0 is what
  they buy). `extra_buffers_allowed(flags)` is the rule, fed the flags so tests need no AMX CPU.
* **Threads** are a setting (`threads`; None = every CPU this process may run on). See
  docs/engines.md for what one and two threads do next to a busy neighbour.
* **One unified KV cache** shared by `n_seq` sequences, so a prompt evaluated once is copied to
  its K completions without copying data (`copy_sequence`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from deployrl.cpu import CpuClass, cpu_class, this_cpu

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


def extra_buffers_allowed(flags: Iterable[str]) -> bool:
    """Whether llama.cpp may use its extra buffer types on a CPU with these flags: not with AMX."""
    return cpu_class(flags) is not CpuClass.AMX


def default_threads() -> int:
    """Every CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LlamaError(RuntimeError):
    """llama.cpp refused a file or a batch."""


class _LoadLog:
    """llama.cpp's log lines while a model loads (the buffer types it chose are printed there)."""

    def __init__(self) -> None:
        import llama_cpp

        self.lines: list[str] = []
        self._llama_cpp = llama_cpp

        @llama_cpp.llama_log_callback
        def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            self.lines.append(text.decode("utf-8", errors="replace"))

        self._callback = collect  # kept alive while llama.cpp may call it

    def __enter__(self) -> "_LoadLog":
        self._llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc) -> None:
        from llama_cpp import _logger

        _logger.logger.setLevel(logging.ERROR)  # llama-cpp-python's own callback: errors only
        self._llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


class LlamaRuntime:
    """A GGUF loaded in llama.cpp with one context: decode batches of (token, position, sequence)."""

    def __init__(
        self,
        path: Path | str,
        n_ctx: int,
        n_seq: int = 1,
        n_batch: int = 512,
        threads: Optional[int] = None,
        flags: Optional[Iterable[str]] = None,
    ) -> None:
        try:
            import llama_cpp
        except ImportError as err:
            raise ImportError("llama.cpp needs llama-cpp-python: pip install 'deployrl[llamacpp]'") from err
        if not 1 <= n_seq <= MAX_SEQUENCES:
            raise ValueError(f"n_seq must be in [1, {MAX_SEQUENCES}] (llama.cpp's limit), got {n_seq}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for every CPU), got {threads}")
        self._lib = llama_cpp
        self._finalizing = sys.is_finalizing  # bound now: at exit the module's globals may be gone
        self.path = Path(path)
        self.flags = this_cpu().flags if flags is None else frozenset(flags)
        self.threads = threads or default_threads()
        self.n_batch = n_batch
        self.model = self.ctx = self.batch = self.adapter = None

        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = extra_buffers_allowed(self.flags)
        self.use_extra_buffers = bool(model_params.use_extra_bufts)
        with _LoadLog() as log:
            self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), model_params)
        self.load_log = "".join(log.lines)
        if not self.model:
            raise LlamaError(f"llama.cpp could not load {self.path}: {self.load_log.strip()[-300:]}")
        self.buffer_types = frozenset(re.findall(r"(\S+) model buffer size", self.load_log))

        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = n_seq
        ctx_params.n_threads = ctx_params.n_threads_batch = self.threads
        ctx_params.kv_unified = True  # one cache: a copied prompt shares its cells with the copies
        ctx_params.no_perf = True
        with _LoadLog() as log:  # what it prints (e.g. a context longer than the model was trained on) is no error
            self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            said = "".join(log.lines).strip()[-300:]
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}: {said}")
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_seq = n_seq
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def set_adapter(self, path: Optional[Path]) -> None:
        """Apply the GGUF LoRA adapter at `path` at scale 1 in place of the current one (None: none),
        and free the old one: the model stays loaded. The KV cache is cleared (it holds keys and
        values of the old weights)."""
        adapter = None
        if path is not None:
            adapter = self._lib.llama_adapter_lora_init(self.model, str(path).encode())
            if not adapter:
                raise LlamaError(f"llama.cpp could not load the LoRA adapter {path} onto {self.path.name}")
            adapters = (self._lib.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(1.0)
            status = self._lib.llama_set_adapters_lora(self.ctx, adapters, 1, scales)
        else:
            status = self._lib.llama_set_adapters_lora(self.ctx, None, 0, None)
        if status != 0:
            raise LlamaError(f"llama.cpp could not apply the LoRA adapter {path} (status {status})")
        if self.adapter:
            self._lib.llama_adapter_lora_free(self.adapter)
        self.adapter = adapter
        self.clear()

    def close(self) -> None:
        lib = self._lib
        if self.adapter:
            lib.llama_adapter_lora_free(self.adapter)
            self.adapter = None
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        if not self._finalizing():  # at exit llama-cpp-python's bindings may already be gone
            self.close()

    def clear(self) -> None:
        """Empty the KV cache."""
        self._lib.llama_memory_clear(self.memory, True)

    def copy_sequence(self, source: int, target: int, until: int = -1) -> None:
        """Make `target` hold the positions [0, until) of `source` (all for -1): shared cells, no data copied."""
        self._lib.llama_memory_seq_cp(self.memory, source, target, 0, until)

    def drop_sequence(self, seq: int, start: int = 0) -> None:
        """Forget the positions >= start of sequence `seq` (all of it for 0)."""
        self._lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool]
    ) -> torch.Tensor:
        """Run one batch of entries (token, position, sequence, whether to return its logits).

        Returns the logits [n_outputs, vocab] float32 of the entries with outputs=True, in order.
        A batch longer than n_batch runs as several llama_decode calls.
        """
        parts = [slice(start, start + self.n_batch) for start in range(0, len(tokens), self.n_batch)]
        return torch.cat([self._decode_one(tokens[s], positions[s], seqs[s], outputs[s]) for s in parts])

    def _decode_one(self, tokens, positions, seqs, outputs) -> torch.Tensor:
        batch, n = self.batch, len(tokens)
        batch.n_tokens = n
        for i in range(n):
            batch.token[i] = tokens[i]
            batch.pos[i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seqs[i]
            batch.logits[i] = bool(outputs[i])
        status = self._lib.llama_decode(self.ctx, batch)
        if status != 0:
            what = {1: "no room in the KV cache", 2: "aborted", -1: "invalid batch"}.get(status, "fatal error")
            raise LlamaError(f"llama_decode failed ({what}, status {status}) on a batch of {n} tokens from {self.path.name}")
        rows = sum(1 for o in outputs if o)
        if rows == 0:
            return torch.empty(0, self.n_vocab)
        pointer = self._lib.llama_get_logits(self.ctx)
        array = np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))
        return torch.from_numpy(array.copy())

    def score(self, token_ids: Sequence[int], seq: int = 0) -> torch.Tensor:
        """log p(token_ids[t] | token_ids[:t]) for t >= 1, [len - 1] float32, under the raw softmax.

        Uses sequence `seq` of an otherwise idle cache and leaves it empty."""
        n = len(token_ids)
        self.drop_sequence(seq)
        logits = self.decode(list(token_ids), list(range(n)), [seq] * n, [True] * (n - 1) + [False])
        self.drop_sequence(seq)
        targets = torch.tensor(token_ids[1:], dtype=torch.long)
        return logits.log_softmax(dim=-1).gather(-1, targets[:, None])[:, 0]
