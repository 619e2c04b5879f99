"""``kvpool-console pin --tokens``: a token list that starts with ``-`` (argparse took it for an
option: ``expected one argument``) or holds a negative id is one line naming ``--tokens`` and
what a token id is, exit 2, before the hub is asked anything. A token id is the model
tokenizer's, 0..4294967295 (``PinArgs.token_ids``): never negative, so ``--tokens -5,3`` and
``--tokens=-5,3`` are refused alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_console.cli import main

LINE = "pin: --tokens: token ids are integers in 0..4294967295\n"


@pytest.mark.parametrize("tokens", [["--tokens", "-5,3"], ["--tokens=-5,3"],
                                    ["--tokens", "-5"], ["--tokens", "5,-3"]])
def test_a_negative_token_id_is_one_line_and_exit_2(
        hub: str, capsys: pytest.CaptureFixture[str], tokens: list[str]) -> None:
    rc = main(["pin", "--model", "m", *tokens, "--hub", hub])
    assert (rc, *capsys.readouterr()) == (2, "", LINE)


def test_bad_tokens_are_refused_without_a_hub() -> None:
    # The installed command, its hub nowhere: the input's line, not the hub's.
    for tokens in (["--tokens", "-5,3"], ["--tokens", "1,x"]):
        run = subprocess.run([sys.executable, "-m", "kvpool_console.cli", "pin", "--model", "m",
                              *tokens, "--hub", "tcp://127.0.0.1:1", "--wait", "0.2"],
                             capture_output=True, text=True, timeout=60, check=False,
                             cwd=Path(__file__).parents[2])
        assert run.returncode == 2 and run.stdout == "", run
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("pin: --tokens: "), run
        assert "hub" not in run.stderr, run
