"""How a run stops: the errors it raises, each saying what and what to do, and the signals it obeys."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run stopped on a fault it could not work around; the message says what and what to do."""


class EngineError(TrainingError):
    """The rollout engine failed on every attempt (`rollout.max_retries` retries on fresh engines)."""


class EngineTimeout(TimeoutError):
    """A generation call ran past `rollout.timeout_s`."""


class RewardFailure(TrainingError):
    """The reward failed on every completion of a step."""


class NonFiniteError(TrainingError):
    """`optim.max_skipped_steps` steps in a row had a non-finite loss or gradient."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; `checkpoint` is where it resumes from (None: the start).

    A KeyboardInterrupt, so that `except Exception` clauses do not swallow it.
    """

    def __init__(self, message: str, signum: int, checkpoint: Optional[Path] = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.checkpoint = checkpoint


class StopSignals:
    """Within `with`: the first SIGINT or SIGTERM is recorded in `signum` (the loop stops after
    the current step); a second one raises TrainingInterrupted at once, abandoning the step.

    Handlers are installed only in the main thread (the only one Python delivers signals to)
    and the previous ones are restored on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the best guess
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise TrainingInterrupted(f"a second {name} abandoned the step in progress", signum)
        self.signum = signum
        log.warning("%s: stopping after the current step, with a checkpoint (send it again to stop at once,"
                    " losing the steps since the last checkpoint)", name)
