"""The GPU check (docs/gpu.md): deployrl's trainer on one CUDA device, in one command and one JSON.

    scripts/gpu_check.sh                                   # a GPU machine: CUDA, Qwen2.5-1.5B shape
    scripts/gpu_check.sh --device cpu --shape tiny         # the dry run, on any machine

Made for a short run on a machine without network: nothing is downloaded there. Before carrying
the working tree over, `--prepare` (run here, with the test venv) writes `.gpu_check/`: the
tokenizer of the embedded model and the pure-Python wheels a bare GPU stack lacks (math-verify
and its parser), about 5 MB. The model is built from a config with random weights, so no
weights travel. Steps, each timed:

1. environment: torch, transformers, the card, its compute capability;
2. training: `--steps` steps with `hf:bf16` sampling and as many with `hf:fp8` (real FP8
   matmuls through `torch._scaled_mm` on compute capability >= 8.9, simulated elsewhere; with
   vLLM installed, `--engines vllm:bf16,vllm:fp8` colocates vLLM instead, recording the card's
   free memory around each sleep), LoRA
   on the fp32 trainer with bf16 autocast (the defaults on CUDA); asserts that the model and the
   optimizer state live on the device; s/step, sampled tokens/s, peak memory, mean D;
3. tests: the device-parametrized tests, on this device (`-k <device>`);
4. `deployrl bench update` (full fine-tuning, GRPO against PS-PPO prefix-only) at `--t-max`.

The JSON (`--out`) holds every number; its fields are listed in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PREPARED = ROOT / ".gpu_check"
WHEELS = ("math-verify", "latex2sympy2_extended", "antlr4-python3-runtime")  # pure Python, not on a bare GPU stack
# the model shapes: Qwen2.5-1.5B's (random weights), and a tiny one for the dry run
SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
}


def prepare(prepared: Path, wheels: bool = True) -> None:
    """Write `prepared`: the embedded model's tokenizer and (`wheels`) the wheels of WHEELS, at the
    versions installed here."""
    from importlib.metadata import version

    from deployrl.models.loading import load_tokenizer, resolve_model

    load_tokenizer(resolve_model("smollm2-135m"), False).save_pretrained(prepared / "tokenizer")
    pins = [f"{name}=={version(name)}" for name in WHEELS] if wheels else []
    if pins:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(prepared / "wheels"),
                        *pins], check=True)
    print(f"prepared {prepared}: tokenizer, wheels {', '.join(pins) or 'none'}")


def install_missing_wheels(prepared: Path) -> list[str]:
    """pip-install the carried wheels of the packages this Python lacks (offline); their names."""
    from importlib.util import find_spec

    missing = [name for name, module in zip(WHEELS, ("math_verify", "latex2sympy2_extended", "antlr4"))
               if find_spec(module) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                        str(prepared / "wheels"), *missing], check=True)
    return missing


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(device), "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                 "gpu_memory_gib": props.total_memory / 2**30}
    return info


def build_model(shape: str, directory: Path, prepared: Path) -> dict[str, Any]:
    """A random-init Qwen2 model of `shape` with the carried tokenizer, saved as an HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(prepared / "tokenizer")
    config = Qwen2Config(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()), **SHAPES[shape]}


def arithmetic_task(directory: Path, count: int = 64) -> Path:
    """A JSONL task of one-digit sums, graded by math-verify (`task.reward=math`)."""
    path = directory / "sums.jsonl"
    pairs = [(i % 10, i // 10 % 10) for i in range(count)]
    lines = [json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) for a, b in pairs]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_memory_around_release(engine) -> list[tuple[float, float]]:
    """The card's free GiB before and after each `engine.release()` (a vLLM engine's sleep), recorded
    into the returned list as the run goes."""
    record, release = [], engine.release

    def measured() -> None:
        before = torch.cuda.mem_get_info()[0]
        release()
        record.append((before / 2**30, torch.cuda.mem_get_info()[0] / 2**30))

    engine.release = measured
    return record


def train(model_dir: Path, task: Path, engine: str, device: str, steps: int, max_new_tokens: int,
          output_dir: Path) -> dict[str, Any]:
    """`steps` training steps sampling with `engine`; what they took, and where the state lived."""
    from deployrl.settings.config import load_config
    from deployrl.training.trainer import Trainer

    config = load_config(None, [
        f"model.name={model_dir}", f"model.device={device}", "task.type=jsonl", f"task.path={task}",
        "task.reward=math", f"rollout.engine={engine}", "rollout.prompts_per_step=8", "rollout.group_size=4",
        f"rollout.max_new_tokens={max_new_tokens}", "rollout.context_length=512", "algo.dynamic_sampling=off",
        f"algo.ps.budget={min(16, max_new_tokens // 2)}",
        f"steps={steps}", f"save_every={steps}", "eval.num_prompts=0", "tensorboard=false", f"output_dir={output_dir}",
    ])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config)
    where = trainer.world.device
    sleeps = free_memory_around_release(trainer.rollout.engine) if cuda else []
    history = trainer.run()
    states = [t for s in trainer.learner.optimizer.state.values() for t in s.values() if t.dim() > 0]
    on_device = all(p.device == where for p in trainer.model.parameters()) and all(t.device == where for t in states)
    result = {
        "engine": engine, "device": str(where), "steps": len(history), "state_on_device": on_device,
        "autocast": str(trainer.learner.passes.scorer.autocast),
        "s_per_step": [m["time/step"] for m in history],
        "rollout_s": [m["time/rollout"] for m in history], "update_s": [m.get("time/update") for m in history],
        "sync_s": [m.get("time/sync") for m in history],
        "sampled_tokens_per_s": [m["engine/tokens_per_s"] for m in history],
        "mean_D": [m.get("dc/mean_D") for m in history], "loss": [m.get("loss") for m in history],
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "free_gib_before_after_release": sleeps,
    }
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if not on_device:
        raise AssertionError(f"{engine}: the model or the optimizer state is not on {where}")
    return result


def source_env() -> dict[str, str]:
    """This process's environment with the working tree's deployrl first on the path."""
    return os.environ | {"PYTHONPATH": str(ROOT / "src")}


def run_tests(device: str, junit: Path) -> dict[str, Any]:
    """The device-parametrized tests on `device` (pytest -k), counted from their JUnit report."""
    files = ["tests/test_device.py", "tests/test_trainer.py", "tests/test_models.py", "tests/test_lora.py"]
    # -o addopts: the repository runs tests under pytest-xdist, which a bare GPU stack lacks
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider", "-k", device,
               f"--junitxml={junit}", *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=source_env())
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    text = junit.read_text() if junit.exists() else ""
    counts = {k: int(v) for k, v in re.findall(r'\b(tests|failures|errors|skipped)="(\d+)"', text)[:4]}
    return {"returncode": done.returncode, **counts}


def bench_update(model_dir: Path, device: str, t_max: list[int], out: Path) -> dict[str, Any]:
    """`deployrl bench update` with full fine-tuning: GRPO against PS-PPO prefix-only (engine proxies)."""
    command = [sys.executable, "-m", "deployrl", "bench", "update", "--model", str(model_dir), "--layers", "0",
               "--t-max", *map(str, t_max), "--methods", "grpo", "ps:optimized:engine", "--repeats", "1",
               "--budget", str(min(128, min(t_max) // 4)),
               "--device", device, "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=source_env())
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    if done.returncode:
        return {"returncode": done.returncode}
    rows = json.loads(out.read_text())["measurements"]
    summary = {}
    for size in t_max:
        by = {r["method"]: r for r in rows if r["t_max"] == size}
        grpo, ps = by["grpo"], by["ps:optimized:engine"]
        summary[str(size)] = {"grpo_s": grpo["seconds"], "ps_s": ps["seconds"],
                              "speedup": grpo["seconds"] / ps["seconds"], "grpo_peak_gib": grpo["peak_bytes"] / 2**30,
                              "ps_peak_gib": ps["peak_bytes"] / 2**30,
                              "memory_ratio": ps["peak_bytes"] / grpo["peak_bytes"]}
    return {"returncode": 0, "t_max": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="write --prepared (tokenizer, wheels) and stop")
    parser.add_argument("--prepared", type=Path, default=PREPARED, help="the folder --prepare writes")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the trainer's device")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES), help="the random-init model's shape")
    parser.add_argument("--steps", type=int, default=3, help="training steps per engine")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens sampled per completion in training")
    parser.add_argument("--t-max", type=int, nargs="+", default=[4096, 16384], help="bench update's completion lengths")
    parser.add_argument("--engines", default="hf:bf16,hf:fp8",
                        help="the engines training samples with (with vLLM installed: vllm:bf16,vllm:fp8)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "tests", "bench"], help="steps to leave out")
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepared)
        return 0
    if not (args.prepared / "tokenizer").is_dir():
        raise SystemExit(f"{args.prepared} is missing: run `scripts/gpu_check.sh --prepare` where the test venv is")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device: this torch ({torch.__version__}) sees none; the dry run is --device cpu")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    report: dict[str, Any] = {"environment": environment(device),
                              "installed_wheels": install_missing_wheels(args.prepared), "seconds": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deployrl-gpu-check-") as scratch:
        work = Path(scratch)
        report["model"] = build_model(args.shape, work / "model", args.prepared)
        task = arithmetic_task(work)
        report["seconds"]["build"] = time.perf_counter() - start
        if "train" not in args.skip:
            report["train"] = []
            for engine in args.engines.split(","):
                began = time.perf_counter()
                report["train"].append(train(work / "model", task, engine, args.device, args.steps, args.max_new_tokens,
                                             work / f"run-{engine.replace(':', '-')}"))
                report["seconds"][f"train {engine}"] = time.perf_counter() - began
        if "tests" not in args.skip:
            began = time.perf_counter()
            report["tests"] = run_tests(args.device, work / "junit.xml")
            report["seconds"]["tests"] = time.perf_counter() - began
        if "bench" not in args.skip:
            began = time.perf_counter()
            report["bench_update"] = bench_update(work / "model", args.device, args.t_max, work / "bench.json")
            report["seconds"]["bench update"] = time.perf_counter() - began
    report["seconds"]["total"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    failed = report.get("tests", {}).get("returncode") or report.get("bench_update", {}).get("returncode")
    print(f"{'FAILED' if failed else 'ok'}: {args.out}, {report['seconds']['total']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
