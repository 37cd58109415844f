"""`deployrl mismatch`: how far is the deployment engine from the trainer?

Samples completions with an engine, recomputes their log-probabilities with the trainer's
model in training precision (same distribution semantics as the engine reports), and reports
the discrepancy: every delta signal's mean and max, the fraction of tokens over a threshold,
delta by token probability and by position, and the engine's speed.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from deployrl.algo.discrepancy import SIGNALS, discrepancy_summary, token_discrepancy
from deployrl.engines import check_model_file, engine_help, held_weights, make_engine, parse_engine_spec
from deployrl.engines.base import RolloutBatch, SamplingParams, trainer_view
from deployrl.engines.check import check_engine, check_ids, reference_logprobs, verify_engine
from deployrl.models.loading import (
    ModelSource,
    Scorer,
    end_token_ids,
    gguf_read_once,
    load_model,
    load_tokenizer,
    output_head,
    resolve_model,
    token_logprobs,
)
from deployrl.registry import unknown_name_error
from deployrl.settings.command_line import CommandLine, Flag
from deployrl.settings.docs import setting
from deployrl.settings.model import DTYPES
from deployrl.tasks.prompts import encode_prompts


@dataclass(frozen=True)
class MismatchConfig:
    """What to compare. Every field is checked on construction, before any model loads."""

    model: str = setting("smollm2-135m", "model directory, .gguf file, hub id or alias")
    engine: str = setting("llamacpp:q4_1", lambda: f"the deployment engine compared with the trainer, {engine_help()}")
    dtype: str = setting("fp32", f"the trainer's precision: {', '.join(DTYPES)}")
    prompts: Optional[str] = setting(None, ".jsonl (prompt or messages per line) or .txt prompt file; None: the"
                                           " questions of the embedded default task")
    num_prompts: int = setting(8, "how many prompts (the first ones of the file, or of the task)")
    n: int = setting(4, "completions per prompt")
    max_new_tokens: int = setting(64, "the longest completion")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling; 1 = off")
    top_k: int = setting(0, "top-k sampling; 0 = off")
    seed: int = setting(0, "the sampling seed")
    threshold: float = setting(0.01, "report the fraction of tokens with |p_old - p_inf| above this")
    chunk_tokens: int = setting(1024, "tokens per chunk of the trainer's output head")
    match_engine: bool = setting(False, "also recompute on the weights as the engine holds them (model.match_engine)"
                                        " and report both, side by side")
    json: Optional[str] = setting(None, "also write the report as JSON to this path")

    def __post_init__(self) -> None:
        parse_engine_spec(self.engine)
        if self.dtype not in DTYPES:
            raise unknown_name_error("training dtype", self.dtype, list(DTYPES))
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        self.sampling  # validates n, temperature, top_p, top_k, max_new_tokens

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens, seed=self.seed,
        )


def discrepancy_report(
    logp_old: torch.Tensor, batch: RolloutBatch, threshold: float
) -> dict[str, object]:
    """Every delta signal's token mean and max, plus the `diff` signal's summary."""
    mask = batch.mask
    outside = mask & torch.isinf(logp_old)
    if outside.any():
        warnings.warn(
            f"{int(outside.sum())} sampled tokens lie outside the trainer's top-k/top-p support:"
            " the engine and the trainer keep different supports, so their delta is partly an artefact"
        )
    report: dict[str, object] = {"outside_support": int(outside.sum())}
    safe_old = torch.where(outside, torch.full_like(logp_old, -1e4), logp_old)
    for signal in SIGNALS.names():
        delta = token_discrepancy(safe_old, batch.logp_inf, mask, signal)
        report[signal] = {"mean": float(delta[mask].mean()), "max": float(delta[mask].max())}
    delta = token_discrepancy(safe_old, batch.logp_inf, mask, "diff")
    summary = discrepancy_summary(delta, mask, safe_old, threshold)
    report["mean_D"] = float(summary.pop("mean_D"))
    report["frac_over_threshold"] = float(summary.pop("frac_over_tolerance"))
    summary.pop("max_delta")
    report["delta_by_prob"] = {k.split("/")[1]: _finite(v) for k, v in summary.items() if k.startswith("delta_by_prob")}
    report["delta_by_pos"] = {k.split("/")[1]: _finite(v) for k, v in summary.items() if k.startswith("delta_by_pos")}
    return report


def _finite(value: torch.Tensor) -> Optional[float]:
    number = float(value)
    return None if math.isnan(number) else number


def checked_source(config: MismatchConfig) -> ModelSource:
    """The model's source, checked against the engine before anything loads."""
    source = resolve_model(config.model)
    check_model_file(config.engine, config.model, source.gguf_path is not None, "--engine", "--model")
    return source


def run(config: MismatchConfig) -> dict[str, object]:
    from deployrl.settings.config import default_task
    from deployrl.tasks import load_prompt_file, load_task

    if config.prompts:
        prompts = load_prompt_file(Path(config.prompts))
    else:
        prompts = [e.prompt for e in load_task(default_task()).examples]
    prompts = prompts[: config.num_prompts]
    source = checked_source(config)
    tokenizer = load_tokenizer(source)
    model = load_model(source, config.dtype).eval()
    prompt_ids = encode_prompts(tokenizer, prompts)
    eos = end_token_ids(tokenizer, model)

    start = time.perf_counter()
    engine = make_engine(config.engine, model, source, eos)
    build_s = time.perf_counter() - start
    check_gap = verify_engine(engine, model, tokenizer)
    params = config.sampling
    batch = engine.generate(prompt_ids, params)
    start = time.perf_counter()
    with torch.no_grad():
        stats = token_logprobs(
            model, batch.prompt_ids, batch.completion_ids, batch.mask, trainer_view(batch.semantics, params),
            config.chunk_tokens,
        )
    recompute_s = time.perf_counter() - start
    matched = matched_report(config, model, source, tokenizer, engine, batch, params) if config.match_engine else None
    report = {
        "config": asdict(config),
        "semantics": batch.semantics,
        "completions": len(batch.finish_reasons),
        "tokens": int(batch.mask.sum()),
        "stopped": sum(r == "stop" for r in batch.finish_reasons),
        "engine_build_s": build_s,
        "kernel_check_gap": check_gap,
        "engine_tokens_per_s": batch.timing.tokens_per_s,
        "trainer_recompute_s": recompute_s,
    }
    report.update(discrepancy_report(stats.logp, batch, config.threshold))
    if matched is not None:
        report["matched"] = matched
    return report


def matched_report(config: MismatchConfig, model, source: ModelSource, tokenizer, engine, batch: RolloutBatch,
                   params: SamplingParams) -> dict[str, object]:
    """The discrepancy and kernel self-check of the trainer computing on the engine's weights."""
    scorer = Scorer(model, None, held_weights(config.engine, model, source))
    with torch.no_grad():
        logp = token_logprobs(scorer, batch.prompt_ids, batch.completion_ids, batch.mask,
                              trainer_view(batch.semantics, params), config.chunk_tokens).logp
        ids = check_ids(tokenizer, output_head(model).shape[0])
        gap = check_engine(engine, reference_logprobs(scorer, ids), ids, matched=True)
    return {"kernel_check_gap": gap, **discrepancy_report(logp, batch, config.threshold)}


def format_report(report: dict[str, object]) -> str:
    cfg = report["config"]
    lines = [
        f"model {cfg['model']} ({cfg['dtype']} trainer) vs engine {cfg['engine']}, "
        f"{report['semantics']} log-probs",
        f"{report['completions']} completions, {report['tokens']} tokens "
        f"({report['stopped']} stopped, the rest hit max_new_tokens={cfg['max_new_tokens']}), "
        f"temperature {cfg['temperature']:g}, top-p {cfg['top_p']:g}, top-k {cfg['top_k']}",
        "",
        f"{'signal':<8} {'mean':>10} {'max':>10}",
    ]
    for signal in SIGNALS.names():
        lines.append(f"{signal:<8} {report[signal]['mean']:>10.6f} {report[signal]['max']:>10.6f}")
    lines += [
        "",
        f"mean trajectory discrepancy D (diff): {report['mean_D']:.6f}",
        f"tokens with |p_old - p_inf| > {cfg['threshold']:g}: {100 * report['frac_over_threshold']:.2f}%",
        "mean |p_old - p_inf| by trainer probability: "
        + ", ".join(f"{k}: {_fmt(v)}" for k, v in report["delta_by_prob"].items()),
        "mean |p_old - p_inf| by position: " + ", ".join(f"{k}: {_fmt(v)}" for k, v in report["delta_by_pos"].items()),
        "",
        f"engine: built in {report['engine_build_s']:.1f} s, {report['engine_tokens_per_s']:.1f} tokens/s; "
        f"trainer recompute {report['trainer_recompute_s']:.1f} s; kernel self-check mean |logp gap|"
        f" {report['kernel_check_gap']:.4f} (docs/engines.md)",
    ]
    if "matched" in report:
        matched = report["matched"]
        lines += [
            "",
            "trainer on the engine's weights (--match-engine):",
            *(f"{signal:<8} {matched[signal]['mean']:>10.6f} {matched[signal]['max']:>10.6f}" for signal in SIGNALS.names()),
            f"mean trajectory discrepancy D (diff): {matched['mean_D']:.6f} (unmatched {report['mean_D']:.6f});"
            f" kernel self-check mean |logp gap| {matched['kernel_check_gap']:.4f}",
        ]
    if report["outside_support"]:
        lines.append(f"warning: {report['outside_support']} tokens outside the trainer's sampling support")
    return "\n".join(lines)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.5f}"


FLAGS = (
    Flag("--model", "model"),
    Flag("--engine", "engine"),
    Flag("--dtype", "dtype"),
    Flag("--prompts", "prompts"),
    Flag("--num-prompts", "num_prompts"),
    Flag("-n", "n"),
    Flag("--max-new-tokens", "max_new_tokens"),
    Flag("--temperature", "temperature"),
    Flag("--top-p", "top_p"),
    Flag("--top-k", "top_k"),
    Flag("--seed", "seed"),
    Flag("--threshold", "threshold"),
    Flag("--match-engine", "match_engine", const=True),
    Flag("--json", "json"),
)


def main(argv: list[str] | None = None) -> int:
    command_line = CommandLine(
        "deployrl mismatch", MismatchConfig,
        "Sample with a deployment engine, recompute with the trainer, report the discrepancy.", FLAGS,
    )
    config, _ = command_line.parse(argv)
    with gguf_read_once():  # the check, the trainer's model and the engine share one parse of a GGUF
        try:
            checked_source(config)
        except (ValueError, FileNotFoundError) as err:
            command_line.fail(err)
        torch.manual_seed(config.seed)
        report = run(config)
    print(format_report(report))
    if config.json:
        Path(config.json).write_text(json.dumps(report, indent=2))
    return 0
