"""One call with a time limit, for code that cannot be interrupted (an engine's generate, a reward)."""

from __future__ import annotations

import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def call_with_timeout(
    fn: Callable[[], T], timeout_s: Optional[float], timeout_error: Callable[[str], BaseException], name: str
) -> T:
    """fn() in a daemon thread named `name`: its result, or its exception re-raised here.

    Past `timeout_s` seconds (None: no limit, fn runs in this thread) raises
    `timeout_error(message)`. Python cannot stop a thread, so the call is abandoned and keeps
    running in the background: the caller must not reuse what it was working on.
    """
    if timeout_s is None:
        return fn()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise timeout_error(f"{name} did not return within {timeout_s} s (left running in a background thread)")
    if "error" in box:
        raise box["error"]
    return box["value"]
