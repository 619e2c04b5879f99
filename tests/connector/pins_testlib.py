"""Helpers shared by the pin tests (``test_pins.py``, ``test_pin_records_forged.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_held(cond: Callable[[], object], timeout_s: float, what: str) -> float:
    """Seconds until ``cond()`` held (asked every 20 ms); fails the test naming ``what`` after
    ``timeout_s``."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start
