"""``kvpool-replay --kill-policy-after N`` with too few requests: the drill would start the
service again at the replay's end (it said "started again after 30 requests" of 30), so a
replay of 2N requests or fewer is one line, exit 2, before anything starts."""

from __future__ import annotations

import pytest

from kvpool_replay import cli as replay_cli


def test_limit_leaving_no_requests_after_the_restart_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = replay_cli.main(["--limit", "20", "--shared", "--pool-tokens", "300000",
                          "--admission", "service", "--kill-policy-after", "10"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert "--kill-policy-after 10" in line and "more than 20 requests" in line
    assert "this replay has 20" in line and "--limit above 20" in line


def test_help_says_it_needs_requests_after_the_restart(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        replay_cli.main(["--help"])
    assert "more than 2N requests" in " ".join(capsys.readouterr().out.split())


class _Service:
    def kill(self) -> None:
        pass

    def start(self) -> None:
        pass


@pytest.mark.parametrize("total, said", [(3, "the replay's last: no request ran"), (9, None)])
def test_a_restart_with_no_request_left_says_so(total: int, said: str | None) -> None:
    from kvpool_replay._policy_service import PolicyDrill

    lines: list[str] = []
    done = iter([1, 1, 3, 3, 3])  # kill after 1, restart after 3 (the last call's answer)
    drill = PolicyDrill(_Service(), lambda: next(done), 1, 1, 0.0,  # type: ignore[arg-type]
                        lines.append, total=total).start()
    drill._thread.join(5)
    assert drill.restarts == 1 and lines[0] == "policy service killed after 1 requests"
    if said is None:
        assert lines[1] == "policy service started again after 3 requests"
    else:
        assert said in lines[1]
