"""The run directory's logs: config, metrics, samples, TensorBoard, W&B, plots, progress bar.

    run_dir/
      config.yaml        the resolved config
      metrics.jsonl      one line per log() call: {"step": ..., metric: value}; NaN/inf -> null
      samples.jsonl      one line per sample: {"step": ..., "prompt": ..., "completion": ...}
      events.jsonl       one line per start, fault or stop: {"step": ..., "event": ..., ...}; never truncated
      tensorboard/       TensorBoard event files (tensorboard --logdir run_dir/tensorboard)
      plots/             PNG plots written by RunLogger.plot()
      checkpoints/       see deployrl.training.checkpoint

A run directory that already holds metrics or checkpoints is refused unless `resume=True`;
a resumed run drops the lines past the resumed step first (`truncate_after`), so its files hold
every step once. `events.jsonl` is the record of where the run ran (a "started" line per start:
the CPU and its class, the trainer's device, the engine) and of what went wrong (skipped updates,
engine retries, reward failures, interrupts): it keeps the events of steps that were later redone.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
EVENTS = "events.jsonl"
TENSORBOARD = "tensorboard"
PLOTS = "plots"


def _plain(value: Any) -> Any:
    """A JSON value: tensors and numpy values become python ones, NaN and inf become None."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # torch / numpy
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _yaml_plain(value: Any) -> Any:
    """Config values yaml.safe_dump accepts: Paths as strings, tuples as lists."""
    if isinstance(value, Mapping):
        return {str(k): _yaml_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        return value.item()
    return value


def _number(key: str, value: Any) -> Optional[float]:
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunDirectoryError(OSError):
    """The run directory cannot be created or written."""


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and write, flush and remove a probe file in it; RunDirectoryError if that fails.

    Run before the model loads, so that an unwritable or full output directory fails in seconds.
    """
    run_dir = Path(run_dir)
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("deployrl\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise RunDirectoryError(
            err.errno,
            f"cannot write to the run directory {run_dir} (output_dir): {err.strerror or err}"
            f"{f' ({err.filename})' if err.filename else ''}; choose a writable output_dir or free space",
        ) from err


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a .jsonl file; a torn last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: skipping a torn last line", RuntimeWarning, stacklevel=2)
                continue
            raise ValueError(f"{path}:{number}: not a JSON line") from None
    return rows


def _wandb_module():
    try:
        import wandb
    except ImportError:
        return None
    return wandb


class RunLogger:
    """Writes a run's config, metrics and samples; a context manager (`close()` flushes all)."""

    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: Optional[str] = None,
        resume: bool = False,
        resume_step: Optional[int] = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.resume = resume
        existing = [p.name for p in (self.run_dir / METRICS, self.run_dir / SAMPLES) if p.is_file()]
        checkpoints = self.run_dir / "checkpoints"
        if checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()):
            existing.append("checkpoints/")
        if existing and not resume:
            raise FileExistsError(
                f"run directory {self.run_dir} already holds {', '.join(existing)}: resume it"
                " (resume=True, `deployrl train --resume`) or choose another output directory;"
                " nothing was overwritten"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_config(dict(config))
        self._purge_step: Optional[int] = None
        self._tb_enabled = tensorboard
        self._tb = None
        self._wandb = None
        if resume_step is not None:
            self.truncate_after(resume_step)
        self._metrics = open(self.run_dir / METRICS, "a", encoding="utf-8")
        self._samples = None
        self._events = None
        if wandb:
            module = _wandb_module()
            if module is None:
                warnings.warn("wandb logging was asked for but wandb is not installed (pip install wandb);"
                              " logging to metrics.jsonl and TensorBoard only", RuntimeWarning, stacklevel=2)
            else:
                self._wandb = module.init(
                    project=wandb_project or "deployrl", name=self.run_dir.name, dir=str(self.run_dir),
                    config=_yaml_plain(dict(config)), resume="allow" if resume else None,
                )
        self._closed = False

    # -- files

    def _write_config(self, config: dict) -> None:
        import yaml

        text = yaml.safe_dump(_yaml_plain(config), sort_keys=False)
        path = self.run_dir / CONFIG
        if self.resume and path.is_file() and path.read_text(encoding="utf-8") != text:
            n = 1
            while (self.run_dir / f"config.before-resume-{n}.yaml").exists():
                n += 1
            os.replace(path, self.run_dir / f"config.before-resume-{n}.yaml")
        _write_atomic(path, text)

    def _tensorboard(self):
        if self._tb is None and self._tb_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD), purge_step=self._purge_step)
        return self._tb

    def truncate_after(self, step: int) -> None:
        """Drop metric and sample lines with a step past `step` (resuming from that step).

        TensorBoard hides its events past `step` too (SummaryWriter's purge_step).
        """
        for name in (METRICS, SAMPLES):
            path = self.run_dir / name
            if not path.is_file():
                continue
            handle = getattr(self, "_metrics" if name == METRICS else "_samples", None)
            if handle is not None:
                handle.flush()
            rows = read_jsonl(path)
            kept = [r for r in rows if not isinstance(r.get("step"), (int, float)) or r["step"] <= step]
            if len(kept) != len(rows) or path.stat().st_size and not path.read_bytes().endswith(b"\n"):
                _write_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
                if handle is not None:  # the append handle points at the replaced file
                    handle.close()
                    setattr(self, "_metrics" if name == METRICS else "_samples", open(path, "a", encoding="utf-8"))
        self._purge_step = step + 1
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    # -- logging

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One line {"step": step, **metrics} in metrics.jsonl; TensorBoard and W&B scalars."""
        values = {str(k): _number(str(k), v) for k, v in metrics.items()}
        line = {"step": int(step), **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
        self._metrics.write(json.dumps(line, allow_nan=False) + "\n")
        self._metrics.flush()
        writer = self._tensorboard()
        if writer is not None:
            for key, value in values.items():
                writer.add_scalar(key, value, int(step))
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        """Lines {"step": step, **sample} in samples.jsonl (prompt, completion, reward, ...)."""
        if self._samples is None:
            self._samples = open(self.run_dir / SAMPLES, "a", encoding="utf-8")
        for sample in samples:
            line = {"step": int(step), **_plain(dict(sample))}
            self._samples.write(json.dumps(line, allow_nan=False, ensure_ascii=False) + "\n")
        self._samples.flush()

    def log_event(self, step: int, event: str, **details: Any) -> None:
        """One line {"step": step, "event": event, **details} in events.jsonl, flushed at once."""
        if self._events is None:
            self._events = open(self.run_dir / EVENTS, "a", encoding="utf-8")
        line = {"step": int(step), "event": event, **_plain(details)}
        self._events.write(json.dumps(line, allow_nan=False, ensure_ascii=False) + "\n")
        self._events.flush()

    def flush(self) -> None:
        for handle in (self._metrics, self._samples, self._events):
            if handle is not None and not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        for handle in (self._metrics, self._samples, self._events):
            if handle is not None:
                handle.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self._closed = True

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plots

    def plot(self, keys: Optional[list[str]] = None) -> list[Path]:
        """PNG plots of metrics.jsonl in run_dir/plots/; returns the files written.

        By default one file per group (reward, discrepancy, lambda, tokens, step_time), one
        panel per quantity; with `keys`, one file per key. Keys not logged are skipped.
        """
        if self._metrics is not None and not self._metrics.closed:
            self._metrics.flush()
        return plot_metrics(self.run_dir, keys)


# ----------------------------------------------------------------------------- plots

# group name -> function(available keys) -> panels, each a list of keys drawn on one axis
PLOT_GROUPS: dict[str, Callable[[list[str]], list[list[str]]]] = {
    "reward": lambda keys: [[k] for k in keys if k.startswith("reward")],
    "discrepancy": lambda keys: [["dc/mean_D", "dc/tolerance"], ["dc/max_delta"], ["dc/frac_over_tolerance"]],
    "lambda": lambda keys: [["dc/lambda"]],
    "tokens": lambda keys: [["ps/tokens_kept", "ps/tokens_total"]],
    "step_time": lambda keys: [[k for k in keys if k.startswith("time/")]],
}


class SilentLogger:
    """RunLogger's interface, writing nothing: the logger of ranks other than 0 (rank 0 writes
    the run directory)."""

    def __getattr__(self, name: str):
        if not callable(getattr(RunLogger, name, None)) or name.startswith("_"):
            raise AttributeError(f"RunLogger has no method {name!r}")
        return lambda *args, **kwargs: None


def _series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in row.items():
            if key == "step" or not (value is None or isinstance(value, (int, float))):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(math.nan if value is None else float(value))
    return series


def _save_figure(path: Path, panels: list[list[str]], series, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg canvas by default

    fig = Figure(figsize=(7, 2.2 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        for key in panel:
            xs, ys = series[key]
            style = {"linestyle": "--", "color": "gray"} if key == "dc/tolerance" else {}
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key, **style)
        ax.grid(alpha=0.3)
        if len(panel) > 1:
            ax.legend(fontsize="small")
        else:
            ax.set_ylabel(panel[0], fontsize="small")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)


def plot_metrics(run_dir: Path, keys: Optional[list[str]] = None) -> list[Path]:
    """The plots of `RunLogger.plot` from a run directory's metrics.jsonl."""
    run_dir = Path(run_dir)
    series = _series(read_jsonl(run_dir / METRICS))
    available = sorted(series)
    if keys is not None:
        groups = {re.sub(r"[^A-Za-z0-9_.-]+", "_", k): [[k]] for k in keys}
    else:
        groups = {name: select(available) for name, select in PLOT_GROUPS.items()}
    written = []
    for name, panels in groups.items():
        panels = [[k for k in panel if k in series] for panel in panels]
        panels = [p for p in panels if p]
        if not panels:
            continue
        (run_dir / PLOTS).mkdir(exist_ok=True)
        path = run_dir / PLOTS / f"{name}.png"
        _save_figure(path, panels, series, name)
        written.append(path)
    return written


# ----------------------------------------------------------------------------- progress bar


def progress(total: int, initial: int = 0, **kwargs):
    """A tqdm bar over training steps (starting at `initial` when resuming)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, **kwargs)


def _short(value: Any) -> Optional[str]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def format_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """reward (reward/mean or reward), δ (dc/mean_D), λ (dc/lambda) and step time (time/step),
    formatted for `bar.set_postfix`; missing ones are left out."""
    reward_key = next((k for k in ("reward/mean", "reward") if k in metrics), None)
    picks = [("reward", reward_key), ("δ", "dc/mean_D"), ("λ", "dc/lambda"), ("s/step", "time/step")]
    postfix = {}
    for label, key in picks:
        if key is not None and key in metrics and metrics[key] is not None:
            text = _short(metrics[key])
            if text is not None:
                postfix[label] = text
    return postfix


def _mean_over(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _score(row: dict) -> str:
    se = row.get("eval/pass@1_se")
    return f"{row['eval/pass@1']:.3f}" + (f" ± {se:.3f}" if se is not None else "") + f" at step {row['step']}"


def run_summary(rows: list[dict], engine: str) -> list[str]:
    """What a run bought, from its metrics.jsonl rows: the deployment-engine eval at its first and
    last evaluation (± one standard error over problems), the training reward over the first and
    last quarter of the steps, and the discrepancy δ against the tolerance c."""
    lines = []
    evals = [r for r in rows if r.get("eval/pass@1") is not None]
    if evals:
        first, last = evals[0], evals[-1]
        samples = next((k.split("@")[1] for k in first if k.startswith("eval/avg@")), "1")
        text = f"eval pass@1 in {engine} ({first.get('eval/problems', 0):g} problems × {samples}): {_score(first)}"
        if last is not first:
            rise = last["eval/pass@1"] - first["eval/pass@1"]
            text += f" → {_score(last)}: {rise:+.3f}"
            se = math.hypot(first.get("eval/pass@1_se") or 0.0, last.get("eval/pass@1_se") or 0.0)
            if se > 0:
                text += f" ({rise / se:+.1f} s.e.)"
        lines.append(text)
    steps = [r for r in rows if r.get("reward/mean") is not None]
    if steps:
        quarter = max(len(steps) // 4, 1)
        head, tail = steps[:quarter], steps[-quarter:]
        lines.append(f"training reward (engine samples): {_mean_over(head, 'reward/mean'):.3f} over steps"
                     f" {head[0]['step']}–{head[-1]['step']} → {_mean_over(tail, 'reward/mean'):.3f} over steps"
                     f" {tail[0]['step']}–{tail[-1]['step']}")
    measured = [r for r in steps if r.get("dc/mean_D") is not None]
    if measured:
        text = (f"discrepancy δ: {measured[0]['dc/mean_D']:.4f} at step {measured[0]['step']} →"
                f" {measured[-1]['dc/mean_D']:.4f} at step {measured[-1]['step']}")
        c = measured[-1].get("dc/tolerance")
        if c is not None:
            over = sum(r["dc/mean_D"] > c for r in measured)
            text += (f"; tolerance c {c:.4f}, exceeded at {over} of {len(measured)} steps;"
                     f" λ {measured[-1].get('dc/lambda', 0.0):.2f} at the end")
        lines.append(text)
    return lines
