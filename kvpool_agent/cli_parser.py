"""The argument parser of every kvpool command: a usage error is one line and exit 2.

argparse prints the command's whole usage block before its error line (16 lines for
``kvpool-replay``), so the line that names the bad flag ends up below a screenful of
options. Every command here (``kvpool-agent``, ``kvpool-console`` and its demo,
``kvpool-config``, ``kvpool-policy``, ``kvpool-replay``) builds its parser from this class;
subcommands inherit it (``add_subparsers`` makes its parsers of the parent's class).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

__all__ = ["EXIT_USAGE", "CommandParser", "int_at_least"]

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
