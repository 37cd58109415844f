"""Measuring helpers shared by the benchmarks: peak memory of a phase, medians, tables, and
running a measurement in a fresh process (so one configuration's allocations cannot hide or
inflate another's peak)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import psutil
import torch


class PeakMemory:
    """Peak memory above the level at entry, in bytes, of the code inside the `with` block.

    On CUDA: `torch.cuda.max_memory_allocated` (reset at entry). On CPU: the process's resident
    set size, polled every `interval` seconds by a thread; the peak minus the RSS at entry.
    """

    def __init__(self, device: Optional[torch.device] = None, interval: float = 0.002) -> None:
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.interval = interval
        self.peak = 0
        self._process = psutil.Process(os.getpid())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            self._start = self._max = self._rss()
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._start
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, self._rss()) - self._start


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA timer reads nothing true before this)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """`device` for benchmark headers, with the card's name on CUDA (the header names the processor)."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def in_fresh_process(function: str, kwargs: dict[str, Any], timeout: Optional[float] = None) -> dict[str, Any]:
    """Call `module:function(**kwargs)` in a new Python process; its JSON-able dict result.

    The child inherits the environment (thread counts included); its stdout carries the result
    as the last line, its stderr passes through.
    """
    code = (
        "import importlib, json, sys\n"
        "module, name = sys.argv[1].split(':')\n"
        "result = getattr(importlib.import_module(module), name)(**json.loads(sys.argv[2]))\n"
        "print('\\n' + json.dumps(result))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, function, json.dumps(kwargs)], stdout=subprocess.PIPE, text=True, timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{function}({kwargs}) failed in its process (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "–" if value != value else f"{value:.3g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start
