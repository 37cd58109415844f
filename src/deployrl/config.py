"""The configuration of a training run: one validated, frozen dataclass per component.

`load_config(path, overrides)` reads a YAML file (sections named like the fields of
`TrainConfig`) and dotted overrides such as ``algo.dc.tolerance=0.01``; every key and value is
checked before any model or data loads. `TrainConfig()` with no file is the embedded default:
SmolLM2-135M-Instruct on reasoning-gym arithmetic, fp32 trainer, llama.cpp Q4_1 sampling,
DC-GRPO + PS-PPO, sized for about ten minutes on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from deployrl.algo._checks import check_non_negative, check_positive
from deployrl.algo.advantages import ADVANTAGES
from deployrl.algo.discrepancy import CORRECTIONS, PENALTIES, SIGNALS, check_cap, check_dual_settings
from deployrl.algo.losses import AGGREGATIONS, KL_ESTIMATORS, check_loss_settings
from deployrl.algo.prefix import STRATEGIES, UNCERTAINTY_METRICS, check_law_settings
from deployrl.configio import Override, load
from deployrl.engines import ENGINES, LORA_SERVING, parse_engine_spec, serves_lora
from deployrl.engines.base import SamplingParams
from deployrl.engines.llama_runtime import MAX_SEQUENCES
from deployrl.models import ALIASES, DTYPES
from deployrl.registry import unknown_name_error
from deployrl.tasks import ReasoningGymTask, TaskConfig

# The embedded default's task: one-digit additions and subtractions, which SmolLM2-135M answers
# correctly about a fifth of the time at temperature 1 (its last number, without the tags).
EASY_ARITHMETIC = {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
    "allow_parentheses": False, "allow_negation": False,
}


def default_task() -> ReasoningGymTask:
    return ReasoningGymTask(
        name="basic_arithmetic", rg_config=dict(EASY_ARITHMETIC), size=2000, instruction="Answer with only the final number."
    )
SCHEDULES = ("constant", "cosine")
# the attention and MLP projections of Llama, Qwen and Mistral models (peft matches name suffixes)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_LR, FULL_LR = 2e-4, 5e-5  # optim.lr when it is not set
DYNAMIC_SAMPLING = ("off", "drop", "refill")
ENGINE_RANKS = ("all", "main")
MAX_SEED = 2**32 - 1  # numpy's seed range, the narrowest of the generators a run seeds


def held_out_task(config: "TrainConfig") -> TaskConfig:
    """The task a run evaluates on: `eval.task`, else fresh problems of the training task (seed + 1)."""
    return config.eval.task or replace(config.task, seed=config.task.seed + 1)


def _choice(kind: str, value: str, valid) -> None:
    if value not in valid:
        raise unknown_name_error(kind, value, list(valid))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through peft: the base stays frozen at the deployed weights, only adapters train."""

    # r; 0: off, full fine-tuning. On by default: a quantised engine applies an adapter exactly,
    # where re-quantising full-weight updates rounds most of them away (docs/results.md, section 4)
    rank: int = 8
    alpha: float = 16.0  # the adapter's scale is alpha / rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS  # Llama/Qwen/Mistral names of the adapted linear layers

    def __post_init__(self) -> None:
        check_non_negative("rank", self.rank)
        check_positive("alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.rank and not self.target_modules:
            raise ValueError("target_modules is empty: name the linear layers to adapt, e.g. [q_proj, v_proj]")


@dataclass(frozen=True)
class ModelConfig:
    """The trainer's model."""

    name: str = "smollm2-135m"  # HF directory, .gguf file, hub id, or alias
    dtype: str = "fp32"  # training precision: fp32, bf16, fp16
    activation_checkpointing: bool = False  # recompute decoder activations in the backward
    trust_remote_code: bool = False  # never on by default: it runs code from the model repo
    chunk_tokens: int = 1024  # tokens per output-head chunk; no [batch, seq, vocab] tensor
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _choice("training dtype", self.dtype, DTYPES)
        check_positive("chunk_tokens", self.chunk_tokens)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling in the deployment engine."""

    # hf:{fp32,bf16,fp16,fp8}, llamacpp:{f32,f16,bf16,q8_0,q4_0,q4_1},
    # vllm:{bf16,fp16,fp32,fp8,fp8_per_tensor,fp8_per_channel,fp8_per_block} (docs/engines.md)
    engine: str = "llamacpp:q4_1"
    prompts_per_step: int = 4  # prompt groups per training step
    group_size: int = 8  # completions per prompt (K)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0  # 1 = off, the training default
    top_k: int = 0  # 0 = off, the training default
    context_length: int = 2048  # the engine's context (prompt + completion)
    max_retries: int = 2  # a failed, hung or malformed generation is retried this often on a fresh engine
    timeout_s: Optional[float] = None  # seconds one generation call may take before it counts as hung; None: no limit
    engine_ranks: str = "all"  # several ranks: all (each samples its share with its own engine) or main (rank 0 samples all)
    # llamacpp: decode threads, vllm: the CPU cores it binds; None = every CPU (beside a busy neighbour
    # 1 is faster for llamacpp: docs/engines.md)
    threads: Optional[int] = None
    parallel: int = 32  # llamacpp, vllm: completions decoded together in one batch (1 = one at a time)
    # LoRA adapters in the engine: adapter (served beside the frozen base, as deployed adapters run; vLLM:
    # LoRA requests) or merged (vllm only: folded into the base at every sync, then quantised with it)
    lora_serving: str = "adapter"

    def __post_init__(self) -> None:
        parse_engine_spec(self.engine)
        _choice("engine_ranks", self.engine_ranks, ENGINE_RANKS)
        _choice("lora_serving", self.lora_serving, LORA_SERVING)
        if not serves_lora(self.engine, self.lora_serving):
            takes = [name for name in ENGINES if serves_lora(name, self.lora_serving)]
            raise ValueError(f"lora_serving={self.lora_serving} is a {' or '.join(takes)} engine option; {self.engine}"
                             " serves adapters beside the base")
        check_positive("prompts_per_step", self.prompts_per_step)
        check_non_negative("max_retries", self.max_retries)
        if self.threads is not None:
            check_positive("threads", self.threads)
        if not 1 <= self.parallel <= MAX_SEQUENCES:
            raise ValueError(f"parallel must be in [1, {MAX_SEQUENCES}] (llama.cpp's sequence limit), got {self.parallel}")
        if self.timeout_s is not None:
            check_positive("timeout_s", self.timeout_s)
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2, got {self.group_size}: advantages compare each completion with the"
                " others of its prompt, so one completion per prompt has none; set rollout.group_size=2 or more (8 is usual)"
            )
        self.sampling(seed=0)
        if self.context_length <= self.max_new_tokens:
            raise ValueError(
                f"context_length={self.context_length} leaves no room for a prompt next to max_new_tokens="
                f"{self.max_new_tokens} (the engine's context holds both); raise context_length or lower max_new_tokens"
            )

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(
            n=self.group_size, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens, seed=seed,
        )


@dataclass(frozen=True)
class DCConfig:
    """DC-GRPO: the discrepancy constraint mean D <= tolerance, enforced by lambda."""

    signal: str = "diff"  # diff |p_old - p_inf|, ratio |p_old/p_inf - 1|, log |logp_old - logp_inf|
    penalty: str = "full"  # full: A - lambda*delta; hinge: A - lambda*max(0, delta - tolerance)
    tolerance: Optional[float] = None  # c; None: relative_tolerance x the discrepancy of the first batch
    relative_tolerance: float = 2.0  # c = this x mean D measured before the first update
    lr: float = 5.0  # eta, the dual step size
    lam_init: float = 0.0  # lambda_0
    lam_max: float = 10.0

    def __post_init__(self) -> None:
        _choice("discrepancy signal", self.signal, SIGNALS.names())
        _choice("discrepancy penalty", self.penalty, PENALTIES)
        check_positive("relative_tolerance", self.relative_tolerance)
        # the dual controller's own bounds (None: a tolerance measured later, >= 0 by construction)
        check_dual_settings(0.0 if self.tolerance is None else self.tolerance, self.lr, self.lam_max, self.lam_init,
                            lam_name="lam_init")


PROXY_SOURCES = ("trainer", "engine")


@dataclass(frozen=True)
class PSConfig:
    """PS-PPO: which tokens the graded pass backpropagates."""

    strategy: str = "optimized"  # full, uniform, temporal, heuristic, optimized, sgrpo
    budget: float = 16.0  # B: expected backpropagated tokens per completion
    xi_min: float = 0.02  # smallest inclusion probability; xi_min x max_new_tokens <= budget
    uncertainty: str = "tv"  # distance for the reward uncertainty u: tv or l2
    # where the law's inputs come from: engine (what the rollout engine reported while sampling; the
    # trainer never passes a token past a row's cutoff: docs/algorithms.md, "Prefix-only update") or
    # trainer (a no-grad pass over every token first, then the law from its proxies)
    proxies: str = "engine"
    top_m: int = 16  # with engine proxies: most likely tokens per sampled distribution the engine reports (for u)

    def __post_init__(self) -> None:
        check_positive("top_m", self.top_m)
        _choice("cutoff strategy", self.strategy, STRATEGIES.names())
        check_law_settings(self.budget, self.xi_min)  # the law's own bounds
        _choice("uncertainty metric", self.uncertainty, UNCERTAINTY_METRICS)
        _choice("proxy source", self.proxies, PROXY_SOURCES)

    def proxies_from(self, source: str) -> tuple[str, ...]:
        """The proxies the cutoff law takes from `source` (trainer or engine): the strategy's own
        (`CutoffStrategy.proxies`) where `proxies` names that source, none elsewhere."""
        return STRATEGIES.get(self.strategy).proxies if self.proxies == source else ()


@dataclass(frozen=True)
class AlgoConfig:
    """The objective: advantages, clipped surrogate, aggregation, corrections."""

    advantage: str = "grpo"  # grpo (population std), grpo_unbiased_std (sample std: verl, TRL), dr_grpo, rloo
    aggregation: str = "token_mean"  # token_mean, seq_mean_token_mean, seq_mean_token_sum_norm
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO clip-higher
    dual_clip: Optional[float] = None  # > 1 bounds the loss of negative-advantage tokens
    kl_coef: float = 0.0  # KL to the initial policy; 0 = off
    kl_estimator: str = "k3"
    correction: str = "dc"  # mismatch handling: none, tis, mask, dc
    correction_cap: float = 2.0  # C of tis (weight cap) and mask (ratio band [1/C, C])
    dynamic_sampling: str = "drop"  # off; drop zero-variance groups; refill them with new prompts
    max_refill_rounds: int = 2  # refill: extra sampling rounds per step at most
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last N tokens before max_new_tokens; 0 = off
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    micro_batch_tokens: int = 2048  # kept tokens + each group's prompt once, per forward/backward
    dc: DCConfig = field(default_factory=DCConfig)
    ps: PSConfig = field(default_factory=PSConfig)

    def __post_init__(self) -> None:
        _choice("advantage estimator", self.advantage, ADVANTAGES.names())
        _choice("loss aggregation", self.aggregation, AGGREGATIONS.names())
        _choice("KL estimator", self.kl_estimator, KL_ESTIMATORS.names())
        _choice("mismatch correction", self.correction, CORRECTIONS.names())
        _choice("dynamic sampling mode", self.dynamic_sampling, DYNAMIC_SAMPLING)
        check_loss_settings(self.eps_low, self.eps_high, self.dual_clip, self.kl_coef)  # the loss's own bounds
        check_cap(self.correction, self.correction_cap)  # the correction's own bound
        check_positive("ppo_epochs", self.ppo_epochs)
        check_positive("mini_batches", self.mini_batches)
        check_positive("micro_batch_tokens", self.micro_batch_tokens)
        check_non_negative("max_refill_rounds", self.max_refill_rounds)
        check_non_negative("overlong_buffer", self.overlong_buffer)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with gradient clipping and a warmup + cosine (or constant) schedule."""

    lr: Optional[float] = None  # None: 2e-4 with LoRA adapters (model.lora.rank > 0), 5e-5 for full fine-tuning
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    warmup_steps: int = 2
    schedule: str = "constant"  # constant or cosine (to min_lr_ratio x lr at the last step)
    min_lr_ratio: float = 0.1
    max_skipped_steps: int = 3  # consecutive steps with a non-finite loss or gradient before the run stops

    def __post_init__(self) -> None:
        if self.lr is not None:
            check_positive("lr", self.lr)
        check_positive("max_skipped_steps", self.max_skipped_steps)
        check_non_negative("weight_decay", self.weight_decay)
        check_non_negative("grad_clip", self.grad_clip)
        check_non_negative("warmup_steps", self.warmup_steps)
        _choice("lr schedule", self.schedule, SCHEDULES)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation scores and how it samples: a run's `eval` section and `deployrl eval` share these."""

    num_prompts: int = 16  # problems per evaluation (the first ones of the task)
    samples: int = 1  # completions per problem (k of avg@k / pass@k)
    temperature: float = 1.0
    top_k: int = 0  # 1 = greedy
    max_new_tokens: Optional[int] = None  # None: the rollout's
    task: Optional[TaskConfig] = None  # None: held-out examples of the training task

    def __post_init__(self) -> None:
        check_non_negative("num_prompts", self.num_prompts)
        check_positive("samples", self.samples)
        check_positive("temperature", self.temperature)
        check_non_negative("top_k", self.top_k)
        if self.max_new_tokens is not None:
            check_positive("max_new_tokens", self.max_new_tokens)


@dataclass(frozen=True)
class EvalConfig(EvalSettings):
    """Evaluation in the deployment engine before, during and after training."""

    # 64 problems x 2 samples: pass@1 to about ± 0.04 (one s.e.), so that a rise of 0.15 shows
    num_prompts: int = 64
    samples: int = 2
    every: int = 0  # steps between evaluations; 0 = only at the end (if num_prompts > 0)
    before_training: bool = True  # also evaluate the initial model (logged at step 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_non_negative("every", self.every)


@dataclass(frozen=True)
class TrainConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # a section of the default's type (reasoning_gym) updates the default: set rg_config={} to change
    # dataset; a section of another type starts from that type's defaults
    task: TaskConfig = field(default_factory=default_task)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    steps: int = 16  # training steps
    seed: int = 0
    output_dir: str = "runs/default"
    save_every: int = 8  # steps between checkpoints (and one at the end)
    keep_last: int = 2  # checkpoints kept
    log_samples: int = 2  # completions written to samples.jsonl per step
    tensorboard: bool = True
    wandb: bool = False  # only if wandb is installed

    def __post_init__(self) -> None:
        if self.optim.lr is None:  # the usual rate of each kind of training (adapters take larger steps)
            object.__setattr__(self, "optim", replace(self.optim, lr=LORA_LR if self.model.lora.rank else FULL_LR))
        check_positive("steps", self.steps)
        check_positive("save_every", self.save_every)
        check_positive("keep_last", self.keep_last)
        check_non_negative("log_samples", self.log_samples)
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must lie in [0, {MAX_SEED}], got {self.seed}")
        if self.rollout.engine.partition(":")[0] == "llamacpp" and not _is_gguf_model(self.model.name):
            raise ValueError(
                f"rollout.engine={self.rollout.engine} writes the trainer's weights into a GGUF shaped like the"
                f" model's own, so model.name must be a .gguf file or an alias ({', '.join(ALIASES)}), got"
                f" {self.model.name!r}; for a Hugging Face model use rollout.engine=hf:bf16 (or fp32, fp16, fp8)"
            )
        eval_tokens = self.eval.max_new_tokens or self.rollout.max_new_tokens
        if eval_tokens >= self.rollout.context_length:
            raise ValueError(
                f"eval.max_new_tokens={eval_tokens} leaves no room for a prompt in rollout.context_length="
                f"{self.rollout.context_length}; raise context_length or lower eval.max_new_tokens"
            )
        if self.algo.ps.strategy != "full" and self.algo.ps.budget > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.ps.budget={self.algo.ps.budget:g} exceeds rollout.max_new_tokens={self.rollout.max_new_tokens}:"
                f" every token would be kept, so the {self.algo.ps.strategy!r} cutoff law would cut nothing;"
                " lower the budget below max_new_tokens or set algo.ps.strategy=full"
            )
        if self.algo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} exceeds rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        if self.algo.ps.strategy != "full" and self.algo.ps.xi_min * self.rollout.max_new_tokens > self.algo.ps.budget:
            raise ValueError(
                f"algo.ps.xi_min={self.algo.ps.xi_min} x rollout.max_new_tokens={self.rollout.max_new_tokens}"
                f" exceeds algo.ps.budget={self.algo.ps.budget}: the budget could not be met"
            )


def _is_gguf_model(name: str) -> bool:
    """Whether model spec `name` is a GGUF file (or an alias of one)."""
    return name in ALIASES or name.endswith(".gguf")


def load_config(path: Optional[Path] = None, overrides: tuple[Override, ...] | list[Override] = ()) -> TrainConfig:
    """TrainConfig from an optional YAML file plus dotted overrides, fully validated."""
    return load(TrainConfig, path, overrides)
