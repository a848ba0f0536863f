"""The harness's one polling helper: every test that waits for something waits through it.

A test never sleeps a fixed time hoping that something has happened: it names the condition,
and `wait_for` polls it until it holds or a deadline passes, then fails with what it saw last.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T], timeout: float = 30, interval: float = 0.2,
             retry_on: tuple[type[BaseException], ...] = (), describe: Callable[[], str] | None = None,
             abort: Callable[[], str | None] | None = None) -> T:
    """Calls `probe()` until it returns something truthy, and returns that.

    `retry_on`: exceptions that count as "not yet" (a node restarting, a container starting).
    `describe`: more to say when the wait times out (an agent's log, say).
    `abort`: called between polls; a message from it ends the wait at once (a process died).
    On timeout raises TimeoutError naming `what` and the last value or exception seen."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = probe()
            if last:
                return last
        except retry_on as error:
            last = error
        if abort is not None:
            reason = abort()
            if reason:
                raise RuntimeError(f"{reason} while waiting for {what}")
        if time.monotonic() > deadline:
            extra = f"\n{describe()}" if describe is not None else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r}){extra}")
        time.sleep(interval)
