"""Every kvpool command answers a usage error with one line naming the flag, and exit 2."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "kvpool-agent": ("kvpool_agent.cli", ["hub", "--no-such-flag"], "--no-such-flag"),
    "kvpool-config": ("kvpool_config.cli", ["validate", "a.json", "--no-such-flag"],
                      "--no-such-flag"),
    "kvpool-console pin": ("kvpool_console.cli", ["pin"], "--model"),
    "kvpool-policy serve": ("kvpool_policy.cli", ["serve", "--fill", "x"], "--fill"),
    "kvpool-replay": ("kvpool_replay.cli", ["--limit", "x"], "--limit"),
    "kvpool-console --demo": ("kvpool_replay.demo", ["--engines", "x"], "--engines"),
}
"""Program name: (module with ``main``, a bad command line, the flag its error must name)."""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_usage_error_is_one_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    module, argv, flag = COMMANDS[command]
    main: Callable[[list[str]], int] = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"{command}: error: "), err
    assert flag in err and f"(see {command} --help)" in err, err
    assert "usage:" not in err


def test_help_still_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvpool-replay")


@pytest.mark.parametrize(("argv", "says"), [
    (["--log-level", "LOUD", "hub"], "argument --log-level: invalid choice: 'LOUD'"),
    (["store", "--hub", "tcp://127.0.0.1:7600", "--high-watermark", "3"],
     "argument --high-watermark: must be in (0, 1], e.g. 0.9, got 3"),
    (["store", "--hub", "tcp://127.0.0.1:7600", "--lease-ttl-ms", "-2"],
     "argument --lease-ttl-ms: must be >= 0, got -2"),
])
def test_agent_values_argparse_took_are_refused(argv: list[str], says: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A bad log level was a traceback in logging.basicConfig; a watermark of 3 or a negative
    lease ran."""
    from kvpool_agent.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_console_given_the_hubs_listen_address_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--hub tcp://*:7600`` (the hub's own --address form) was a ZMQError traceback."""
    from kvpool_console.cli import main

    assert main(["--hub", "tcp://*:7600", "status"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvpool-console: hub address 'tcp://*:7600': * is where a hub listens; "
                   "connect to the hub's host, e.g. tcp://127.0.0.1:7600\n")


@pytest.mark.parametrize(("module", "argv", "says"), [
    ("kvpool_replay.cli", ["--speedup", "nan"],
     "argument --speedup: must be a number >= 0 (0 = as fast as possible), got nan"),
    ("kvpool_replay.cli", ["--kill-leader-after", "inf"],
     "argument --kill-leader-after: must be a finite number of seconds > 0, got inf"),
    ("kvpool_console.cli", ["status", "--watermark-ratio", "half"],
     "argument --watermark-ratio: 'half' is not a number"),
    ("kvpool_console.cli", ["status", "--watermark-margin", "1.5"],
     "argument --watermark-margin: must be in [0, 1], got 1.5"),
])
def test_every_number_flag_is_refused_in_words(module: str, argv: list[str], says: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One bound for every number flag (``cli_parser.number_in``); the console's fractions
    said argparse's ``invalid _fraction value: 'half'`` before."""
    main: Callable[[list[str]], int] = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("master", "says"), [
    ("notahost", "--master: 'notahost' is not host:port or etcd://host:port"),
    ("127.0.0.1:1", "--master 127.0.0.1:1: nothing answers there (Connection refused): start "
     "mooncake_master first, or leave --master out to start one here"),
])
def test_a_replay_master_that_cannot_serve_is_one_line(
        master: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvpool-replay --master`` was taken as given: a bad or dead master was a 20 s wait and
    a ``mooncake_client did not mount its segment`` traceback (a new user's finding)."""
    from kvpool_replay.cli import main

    try:  # a bad address at parse time; a master not answering before anything starts
        code = main(["--master", master, "--limit", "5"])
    except SystemExit as exited:
        code = exited.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
