"""The configuration of a training run: one validated, frozen dataclass per component.

`load_config(path, overrides)` reads a YAML file (sections named like the fields of
`TrainConfig`) and dotted overrides such as ``algo.dc.tolerance=0.01``; every key and value is
checked before any model or data loads. `TrainConfig()` with no file is the embedded default:
SmolLM2-135M-Instruct on reasoning-gym arithmetic, fp32 trainer, llama.cpp Q4_1 sampling,
DC-GRPO + PS-PPO, sized for about ten minutes on two CPU cores.

Each field's help is written once, on the field (`settings.docs.setting`): flags, `--print-config`
and docs/settings.md are generated from it. The closed vocabularies of this module's settings are
`Choice` enums (`ProxySource`, `Schedule`, `DynamicSampling`, `EngineRanks`); the rest of the code asks the
config (`OptimConfig.decays`, `AlgoConfig.refill_rounds`, `RolloutConfig.every_rank_samples`)
instead of comparing their names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

from deployrl.algo._checks import check_non_negative, check_positive
from deployrl.algo.advantages import ADVANTAGES
from deployrl.algo.corrections import CORRECTIONS
from deployrl.algo.discrepancy import PENALTIES, SIGNALS, check_dual_settings
from deployrl.algo.losses import AGGREGATIONS, KL_ESTIMATORS, check_loss_settings
from deployrl.algo.prefix import STRATEGIES, UNCERTAINTY_METRICS, check_law_settings
from deployrl.engines import (
    ENGINES,
    EngineSettings,
    LoraServing,
    check_model_file,
    engine_help,
    engine_kind,
    lora_serving_help,
    parse_engine_spec,
    serves_lora,
)
from deployrl.engines.base import SamplingParams
from deployrl.engines.llama_runtime import MAX_SEQUENCES
from deployrl.registry import Choice, unknown_name_error
from deployrl.settings.docs import setting
from deployrl.settings.model import ALIASES, DTYPES, Autocast, Device
from deployrl.settings.parsing import Override, load
from deployrl.settings.task import ReasoningGymTask, TaskConfig

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


class ProxySource(Choice):
    """Where the cutoff law's inputs come from, and so the order of a PS-PPO step (`algo.ps.proxies`);
    each is a registered order in `deployrl.training.ps_orders`."""

    ENGINE = "engine", ("what the rollout engine reported while sampling; the trainer never passes a token past a"
                        " row's cutoff")
    TRAINER = "trainer", "a no-grad pass over every token first, then the law from its proxies"


class Schedule(Choice):
    """The learning rate after warmup (`optim.schedule`)."""

    CONSTANT = "constant", "the peak rate"
    COSINE = "cosine", "cosine decay to min_lr_ratio x lr at the last step"


# the attention and MLP projections of Llama, Qwen and Mistral models (peft matches name suffixes)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_LR, FULL_LR = 2e-4, 5e-5  # optim.lr when it is not set
MAX_SEED = 2**32 - 1  # numpy's seed range, the narrowest of the generators a run seeds


class DynamicSampling(Choice):
    """What a step does with groups whose rewards are all equal (`algo.dynamic_sampling`)."""

    OFF = "off", "keep them"
    DROP = "drop", "drop them"
    REFILL = "refill", "drop them and sample new prompts in their place, max_refill_rounds extra rounds at most"


class EngineRanks(Choice):
    """Which ranks of a distributed run sample (`rollout.engine_ranks`)."""

    ALL = "all", "each rank samples its share of the step with its own engine"
    MAIN = "main", "rank 0's engine samples the whole step"


def held_out_task(config: "TrainConfig") -> TaskConfig:
    """The task a run evaluates on: `eval.task`, else fresh problems of the training task (seed + 1)."""
    return config.eval.task or replace(config.task, seed=config.task.seed + 1)


def _choice(kind: str, value: str, valid) -> None:
    if value not in valid:
        raise unknown_name_error(kind, value, list(valid))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through peft: the base stays frozen at the deployed weights, only adapters train."""

    rank: int = setting(8, "the adapters' rank r; 0: off, full fine-tuning. On by default: a quantised engine applies"
                        " an adapter exactly, where re-quantising full-weight updates rounds most of them away"
                        " (docs/results.md, section 4)")
    alpha: float = setting(16.0, "the adapter's scale is alpha / rank")
    dropout: float = setting(0.0, "dropout on the adapters' input, in [0, 1)")
    target_modules: tuple[str, ...] = setting(LORA_TARGETS, "the adapted linear layers (peft matches name suffixes;"
                                                            " the default: every attention and MLP projection of"
                                                            " Llama, Qwen and Mistral)")

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

    name: str = setting("smollm2-135m", "HF directory, .gguf file, hub id, or alias")
    dtype: str = setting("fp32", f"training precision of the weights and optimizer: {', '.join(DTYPES)}")
    device: str = setting("auto", f"where the model, optimizer and passes live: {Device.described()}")
    autocast: str = setting("auto", f"mixed-precision compute: {Autocast.described()}")
    activation_checkpointing: bool = setting(False, "recompute decoder activations in the backward")
    trust_remote_code: bool = setting(False, "run code from the model repository; never on by default")
    chunk_tokens: int = setting(1024, "tokens per output-head chunk; no [batch, seq, vocab] tensor")
    match_engine: bool = setting(False, "compute the trainer's forward on the weights as rollout.engine holds them"
                                        " (its file type or quantisation), straight-through (docs/engines.md)")
    lora: LoraConfig = setting(help="LoRA adapters (docs/training.md, LoRA adapters)", factory=LoraConfig)

    def __post_init__(self) -> None:
        _choice("training dtype", self.dtype, DTYPES)
        Device.get("model.device", self.device)
        if Autocast.get("model.autocast", self.autocast) is Autocast.BF16 and self.dtype != "fp32":
            raise ValueError(f"model.autocast=bf16 casts fp32 weights for the compute; model.dtype is {self.dtype}:"
                             " use model.autocast=off (the compute is already in that dtype)")
        check_positive("chunk_tokens", self.chunk_tokens)
        if self.match_engine and self.activation_checkpointing:
            # the backward's recomputation runs after the matched call has put the weights back
            raise ValueError("model.match_engine computes on the engine's weights only during the forward call;"
                             " activation checkpointing would recompute the layers on the trainer's own weights"
                             " in the backward: turn one of them off")


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling in the deployment engine."""

    engine: str = setting("llamacpp:q4_1", lambda: f"the deployment engine that samples (docs/engines.md),"
                                                   f" {engine_help()}")
    prompts_per_step: int = setting(4, "prompt groups per training step")
    group_size: int = setting(8, "completions per prompt (K), 2 or more")
    max_new_tokens: int = setting(32, "the longest completion, in tokens")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling; 1 = off, the training default")
    top_k: int = setting(0, "top-k sampling; 0 = off, the training default")
    context_length: int = setting(2048, "the engine's context (prompt + completion)")
    max_retries: int = setting(2, "a generation that raises, hangs or returns a malformed batch is retried this often"
                                  " on a fresh engine")
    timeout_s: Optional[float] = setting(None, "seconds one generation call may take before it counts as hung;"
                                               " None: no limit")
    engine_ranks: str = setting("all", f"under torchrun: {EngineRanks.described()} (docs/distributed.md)")
    threads: Optional[int] = setting(None, "llamacpp: decode threads, vllm: the CPU cores it binds; None = every CPU"
                                           " (beside a busy neighbour 1 is faster for llamacpp: docs/engines.md)")
    parallel: int = setting(32, "llamacpp, vllm: completions decoded together in one batch (1 = one at a time)")
    lora_serving: str = setting("adapter", lambda: f"a LoRA run's adapters in the engine: {lora_serving_help()}")
    gpu_memory_utilization: Optional[float] = setting(
        None, "vllm on a GPU: the share of the card vLLM takes (weights and KV cache) beside the trainer; None: the"
              " memory free when it starts, less what the trainer allocates later (AdamW state, a KL reference) and"
              " 10% of the card (docs/gpu.md)")
    enforce_eager: bool = setting(False, "vllm on a GPU: no torch.compile or CUDA graphs (starts faster, decodes"
                                         " slower); always eager on the CPU")
    sleep: bool = setting(True, "vllm on a GPU: sleep mode, the card released while the trainer works (level 1, the"
                                " base offloaded, when adapters are served; level 2 otherwise)")

    def __post_init__(self) -> None:
        parse_engine_spec(self.engine)
        _choice("engine_ranks", self.engine_ranks, EngineRanks.names())
        _choice("lora_serving", self.lora_serving, LoraServing.names())
        if not self.every_rank_samples and engine_kind(self.engine).every_rank:
            raise ValueError(f"rollout.engine={self.engine} needs rollout.engine_ranks=all: "
                             f"{engine_kind(self.engine).every_rank}")
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
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
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

    def engine_settings(self) -> dict:
        """The `EngineSettings` fields this section sets, by name (for `make_engine`)."""
        return {f.name: getattr(self, f.name) for f in fields(EngineSettings) if f.name in self.__dataclass_fields__}

    @property
    def every_rank_samples(self) -> bool:
        """Whether each rank of a distributed run samples its share with its own engine; else
        rank 0's engine samples the whole step (`engine_ranks`)."""
        return EngineRanks(self.engine_ranks) is EngineRanks.ALL

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(
            n=self.group_size, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens, seed=seed,
        )


@dataclass(frozen=True)
class DCConfig:
    """DC-GRPO: the discrepancy constraint mean D <= tolerance, enforced by lambda."""

    signal: str = setting("diff", "the token discrepancy delta: diff |p_old - p_inf|, ratio |p_old/p_inf - 1|,"
                                  " log |logp_old - logp_inf|")
    penalty: str = setting("full", "full: A - lambda*delta; hinge: A - lambda*max(0, delta - tolerance)")
    tolerance: Optional[float] = setting(None, "c; None: relative_tolerance x the discrepancy of the first batch")
    relative_tolerance: float = setting(2.0, "c = this x mean D measured before the first update")
    lr: float = setting(5.0, "eta, the dual step size")
    lam_init: float = setting(0.0, "lambda_0, the multiplier's start")
    lam_max: float = setting(10.0, "the multiplier's upper bound")

    def __post_init__(self) -> None:
        _choice("discrepancy signal", self.signal, SIGNALS.names())
        _choice("discrepancy penalty", self.penalty, PENALTIES)
        check_positive("relative_tolerance", self.relative_tolerance)
        # the dual controller's own bounds (None: a tolerance measured later, >= 0 by construction)
        check_dual_settings(0.0 if self.tolerance is None else self.tolerance, self.lr, self.lam_max, self.lam_init,
                            lam_name="lam_init")


@dataclass(frozen=True)
class PSConfig:
    """PS-PPO: which tokens the graded pass backpropagates."""

    strategy: str = setting("optimized", "the cutoff strategy: full, uniform, temporal, heuristic, optimized, sgrpo"
                                         " (docs/algorithms.md)")
    budget: float = setting(16.0, "B: expected backpropagated tokens per completion")
    xi_min: float = setting(0.02, "smallest inclusion probability; xi_min x max_new_tokens <= budget")
    uncertainty: str = setting("tv", "distance for the reward uncertainty u: tv or l2")
    proxies: str = setting("engine", f"where the cutoff law's inputs come from, and so the order of a step: "
                                     f"{ProxySource.described()} (docs/algorithms.md, \"Prefix-only update\")")
    top_m: int = setting(16, "with engine proxies: most likely tokens per sampled distribution the engine reports"
                             " (for u)")

    def __post_init__(self) -> None:
        check_positive("top_m", self.top_m)
        _choice("cutoff strategy", self.strategy, STRATEGIES.names())
        check_law_settings(self.budget, self.xi_min)  # the law's own bounds
        _choice("uncertainty metric", self.uncertainty, UNCERTAINTY_METRICS)
        _choice("proxy source", self.proxies, ProxySource.names())


@dataclass(frozen=True)
class AlgoConfig:
    """The objective: advantages, clipped surrogate, aggregation, corrections."""

    advantage: str = setting("grpo", "grpo (population std), grpo_unbiased_std (sample std: verl, TRL), dr_grpo, rloo")
    aggregation: str = setting("token_mean", "token_mean, seq_mean_token_mean, seq_mean_token_sum_norm")
    eps_low: float = setting(0.2, "the clip range below 1 of the ratio")
    eps_high: float = setting(0.28, "the clip range above 1 of the ratio (DAPO clip-higher: > eps_low)")
    dual_clip: Optional[float] = setting(None, "> 1 bounds the loss of negative-advantage tokens; None: off")
    kl_coef: float = setting(0.0, "KL to the initial policy; 0 = off")
    kl_estimator: str = setting("k3", "the KL estimator: k1, k2 or k3")
    correction: str = setting("dc", f"mismatch handling: {', '.join(CORRECTIONS.names())} (docs/algorithms.md,"
                                    " \"Mismatch corrections\")")
    correction_cap: float = setting(2.0, "C of the weighting corrections: the weight cap of tis and seq_tis, the"
                                         " ratio band [1/C, C] of mask, seq_mask and geo_mask")
    dynamic_sampling: str = setting("drop", f"groups whose rewards are all equal (with kl_coef = 0):"
                                            f" {DynamicSampling.described()}")
    max_refill_rounds: int = setting(2, "refill: extra sampling rounds per step at most")
    overlong_buffer: int = setting(0, "DAPO soft overlong punishment over the last N tokens before max_new_tokens;"
                                      " 0 = off")
    ppo_epochs: int = setting(1, "passes over each step's batch")
    mini_batches: int = setting(1, "optimizer steps per epoch")
    micro_batch_tokens: int = setting(2048, "kept tokens + each group's prompt once, per forward/backward")
    dc: DCConfig = setting(help="DC-GRPO's discrepancy constraint (correction: dc)", factory=DCConfig)
    ps: PSConfig = setting(help="PS-PPO: the prefix each completion backpropagates", factory=PSConfig)

    def __post_init__(self) -> None:
        _choice("advantage estimator", self.advantage, ADVANTAGES.names())
        _choice("loss aggregation", self.aggregation, AGGREGATIONS.names())
        _choice("KL estimator", self.kl_estimator, KL_ESTIMATORS.names())
        _choice("mismatch correction", self.correction, CORRECTIONS.names())
        _choice("dynamic sampling mode", self.dynamic_sampling, DynamicSampling.names())
        check_loss_settings(self.eps_low, self.eps_high, self.dual_clip, self.kl_coef)  # the loss's own bounds
        CORRECTIONS.get(self.correction).check_cap(self.correction_cap)  # the correction's own bound
        check_positive("ppo_epochs", self.ppo_epochs)
        check_positive("mini_batches", self.mini_batches)
        check_positive("micro_batch_tokens", self.micro_batch_tokens)
        check_non_negative("max_refill_rounds", self.max_refill_rounds)
        check_non_negative("overlong_buffer", self.overlong_buffer)

    @property
    def refill_rounds(self) -> Optional[int]:
        """Extra sampling rounds per step that replace the groups whose rewards are all equal (0: they
        are only dropped); None: they are kept (`dynamic_sampling` off, or a KL term: they still teach)."""
        mode = DynamicSampling(self.dynamic_sampling)
        if mode is DynamicSampling.OFF or self.kl_coef != 0:
            return None
        return self.max_refill_rounds if mode is DynamicSampling.REFILL else 0


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with gradient clipping and a warmup + cosine (or constant) schedule."""

    lr: Optional[float] = setting(None, f"the peak learning rate; None: {LORA_LR:g} with LoRA adapters"
                                        f" (model.lora.rank > 0), {FULL_LR:g} for full fine-tuning")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay")
    beta1: float = setting(0.9, "AdamW's first-moment decay")
    beta2: float = setting(0.99, "AdamW's second-moment decay")
    grad_clip: float = setting(1.0, "max global grad norm; 0 = off")
    warmup_steps: int = setting(2, "steps of linear warmup to lr")
    schedule: str = setting("constant", f"after warmup: {Schedule.described()}")
    min_lr_ratio: float = setting(0.1, "cosine: the rate at the last step, as a fraction of lr")
    max_skipped_steps: int = setting(3, "consecutive steps with a non-finite loss or gradient before the run stops")

    def __post_init__(self) -> None:
        if self.lr is not None:
            check_positive("lr", self.lr)
        check_positive("max_skipped_steps", self.max_skipped_steps)
        check_non_negative("weight_decay", self.weight_decay)
        check_non_negative("grad_clip", self.grad_clip)
        check_non_negative("warmup_steps", self.warmup_steps)
        _choice("lr schedule", self.schedule, Schedule.names())
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")

    @property
    def decays(self) -> bool:
        """Whether the rate decays after warmup (to min_lr_ratio x lr), else stays at lr (`schedule`)."""
        return Schedule(self.schedule) is Schedule.COSINE


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation scores and how it samples: a run's `eval` section and `deployrl eval` share these."""

    num_prompts: int = setting(16, "problems per evaluation (the first ones of the task)")
    samples: int = setting(1, "completions per problem (k of avg@k / pass@k)")
    temperature: float = setting(1.0, "sampling temperature")
    top_k: int = setting(0, "top-k sampling; 0 = off, 1 = greedy")
    max_new_tokens: Optional[int] = setting(None, "the longest completion; None: the rollout's")
    task: Optional[TaskConfig] = setting(None, "the task scored; None: held-out examples of the training task (a"
                                               " section here needs its type: docs/tasks.md)")

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
    every: int = setting(0, "steps between evaluations; 0 = only at the end (if num_prompts > 0)")
    before_training: bool = setting(True, "also evaluate the initial model (logged at step 0)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_non_negative("every", self.every)


@dataclass(frozen=True)
class TrainConfig:
    """A whole run."""

    model: ModelConfig = setting(help="the trainer's model", factory=ModelConfig)
    task: TaskConfig = setting(help="the training task, by type (docs/tasks.md): a section of the default's type"
                                    " (reasoning_gym) updates the default (set rg_config={} to change dataset), a"
                                    " section of another type starts from that type's defaults", factory=default_task)
    rollout: RolloutConfig = setting(help="sampling in the deployment engine", factory=RolloutConfig)
    algo: AlgoConfig = setting(help="the objective", factory=AlgoConfig)
    optim: OptimConfig = setting(help="the optimizer and its schedule", factory=OptimConfig)
    eval: EvalConfig = setting(help="evaluation in the deployment engine", factory=EvalConfig)
    steps: int = setting(16, "training steps")
    seed: int = setting(0, "the run's seed: data order, sampling, cutoff draws")
    output_dir: str = setting("runs/default", "the run directory: metrics, samples, checkpoints")
    save_every: int = setting(8, "steps between checkpoints (and one at the end)")
    keep_last: int = setting(2, "checkpoints kept")
    log_samples: int = setting(2, "completions written to samples.jsonl per step")
    tensorboard: bool = setting(True, "also log the metrics to TensorBoard")
    wandb: bool = setting(False, "also log the metrics to Weights & Biases (if wandb is installed)")

    def __post_init__(self) -> None:
        if self.optim.lr is None:  # the usual rate of each kind of training (adapters take larger steps)
            object.__setattr__(self, "optim", replace(self.optim, lr=LORA_LR if self.model.lora.rank else FULL_LR))
        check_positive("steps", self.steps)
        check_positive("save_every", self.save_every)
        check_positive("keep_last", self.keep_last)
        check_non_negative("log_samples", self.log_samples)
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must lie in [0, {MAX_SEED}], got {self.seed}")
        check_model_file(self.rollout.engine, self.model.name, _is_gguf_model(self.model.name), "rollout.engine",
                         "model.name")
        eval_tokens = self.eval.max_new_tokens or self.rollout.max_new_tokens
        if eval_tokens >= self.rollout.context_length:
            raise ValueError(
                f"eval.max_new_tokens={eval_tokens} leaves no room for a prompt in rollout.context_length="
                f"{self.rollout.context_length}; raise context_length or lower eval.max_new_tokens"
            )
        if STRATEGIES.get(self.algo.ps.strategy).budgeted and self.algo.ps.budget > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.ps.budget={self.algo.ps.budget:g} exceeds rollout.max_new_tokens={self.rollout.max_new_tokens}:"
                f" every token would be kept, so the {self.algo.ps.strategy!r} cutoff law would cut nothing;"
                " lower the budget below max_new_tokens or set algo.ps.strategy=full"
            )
        if self.algo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} exceeds rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        budgeted = STRATEGIES.get(self.algo.ps.strategy).budgeted
        if budgeted and self.algo.ps.xi_min * self.rollout.max_new_tokens > self.algo.ps.budget:
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
