"""The argument parser of every kvpool command: a usage error is one line and exit 2.

argparse prints the command's whole usage block before its error line (16 lines for
``kvpool-replay``), so the line that names the bad flag ends up below a screenful of
options. Every command here (``kvpool-agent``, ``kvpool-console`` and its demo,
``kvpool-config``, ``kvpool-policy``, ``kvpool-replay``) builds its parser from this class;
subcommands inherit it (``add_subparsers`` makes its parsers of the parent's class).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

__all__ = ["EXIT_USAGE", "CommandParser", "int_at_least", "number_in"]

EXIT_USAGE = 2
"""Exit status of a usage error, as argparse and every kvpool command use it."""


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage error is one line naming the flag and ``--help``.

    ``prog: error: argument --limit: 'x' is not an integer (see prog --help)`` on stderr, exit
    2; ``--help`` prints the usage block as before.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``; anything else is refused in words
    (``'x' is not an integer``, ``must be >= 1, got 0``), argparse naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def number_in(low: float, high: float = math.inf, *, low_open: bool = False,
              finite: bool = True, unit: str = "", hint: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a number from ``low`` (excluded with ``low_open``) to ``high``;
    NaN never, infinity only without ``finite`` (and ``high`` infinite). Anything else is
    refused in words, argparse naming the option: ``'x' is not a number``, ``must be in (0, 1],
    got 3``, ``must be a finite number of seconds >= 0.25, got -5`` (``unit`` "seconds"),
    ``hint`` appended to the range (e.g. ``" (0 = as fast as possible)"``)."""
    of = f" of {unit}" if unit else ""
    if high < math.inf:
        span = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        span = f"a {'finite ' if finite else ''}number{of} {'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{of}") from None
        fits = (value > low if low_open else value >= low) and value <= high
        if not fits or (finite and not math.isfinite(value)):  # NaN fits nothing
            raise argparse.ArgumentTypeError(f"must be {span}{hint}, got {text}")
        return value

    return parse
