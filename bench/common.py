"""What the benchmarks share: output, percentiles, and one sampling thread.

ccm_bench.py and steady.py import it (steady.py is imported by ccm_bench.py too, so neither
can import the other's helpers)."""

from __future__ import annotations

import math
import threading
import time


def say(text: str = "") -> None:
    print(text, flush=True)


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100), interpolated between the nearest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def server_settings(parser, items: list[str]) -> dict[str, str]:
    """The --set NAME=VALUE options as postgresql.conf settings (values quoted); a malformed
    one is the parser's error."""
    try:
        return {name.strip(): f"'{value.strip()}'" for name, value in (item.split("=", 1) for item in items)}
    except ValueError:
        parser.error("--set: expected NAME=VALUE")


class Sampler:
    """Calls `sample()` every `interval` seconds, on a fixed schedule, in a thread, while the
    `with` block runs; an error in the thread is raised again when the block ends. Subclasses
    define `sample()` and may override `run()` to hold a connection around the loop."""

    what = "sampling"

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=type(self).__name__, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        self.loop(self.sample)

    def loop(self, sample) -> None:
        tick = time.monotonic()
        while not self._stop.is_set():
            sample()
            tick += self.interval
            self._stop.wait(max(0.0, tick - time.monotonic()))

    def _main(self) -> None:
        try:
            self.run()
        except BaseException as error:  # raised again in the caller's thread by __exit__
            self._error = error

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"{self.what} failed: {self._error}") from self._error
