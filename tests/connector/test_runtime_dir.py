"""The lookup socket's per-user runtime directory, attacked the way a local user could: a
directory planted in the shared temp dir (symlinked, owned by someone else, group-writable) and
symbolic links planted at the socket and owner file names. Each is refused with a message naming
the path and the fix, and the attack has no effect (the link's target is neither written nor
truncated). Real ZMQ sockets."""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpool_connector._runtime_dir import (
    SUN_PATH_MAX,
    RuntimeDirError,
    create_private_file,
    runtime_dir,
)
from kvpool_connector.lookup import (
    LookupClient,
    LookupServer,
    lookup_socket_path,
    release_if_dead,
)


def _serve(port: int = 7101) -> tuple[LookupServer, LookupClient]:
    return (LookupServer(lambda h: len(h), lookup_rpc_port=port, engine_id="e"),
            LookupClient(lookup_rpc_port=port, timeout_ms=2000))


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rt").mkdir(mode=0o700)
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path / "rt"))


@pytest.fixture
def default_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No ``KVPOOL_RUNTIME_DIR`` nor ``XDG_RUNTIME_DIR``; the temp dir is ``tmp_path/tmp``
    (mode 1777, like /tmp). Returns the runtime directory the rule picks there."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.delenv("KVPOOL_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared / f"kvpool-{os.geteuid()}"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_default_dir_is_created_0700_per_user_and_serves(default_chain: Path) -> None:
    server, client = _serve()
    try:
        assert server.path.parent == default_chain
        assert _mode(default_chain) == 0o700
        assert os.lstat(default_chain).st_uid == os.geteuid()
        assert _mode(Path(str(server.path) + ".owner")) == 0o600
        assert client.lookup(["a", "b"]) == 2
    finally:
        client.close()
        server.close()


def test_xdg_runtime_dir_is_used_when_set(tmp_path: Path, default_chain: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_dir() == xdg / "kvpool"
    assert _mode(xdg / "kvpool") == 0o700
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path / "mine" / "sockets"))
    assert runtime_dir() == tmp_path / "mine" / "sockets"
    assert _mode(tmp_path / "mine" / "sockets") == 0o700
    assert not default_chain.exists()


def test_symlinked_runtime_dir_is_refused(tmp_path: Path, default_chain: Path) -> None:
    # Another user plants kvpool-<uid> in the shared temp dir as a link to a directory of theirs.
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    default_chain.symlink_to(theirs)
    with pytest.raises(RuntimeDirError) as info:
        _serve()
    msg = str(info.value)
    assert f"{default_chain} is a symbolic link" in msg
    assert "remove it, or set KVPOOL_RUNTIME_DIR" in msg
    assert list(theirs.iterdir()) == []  # no socket, no owner file written through the link
    with pytest.raises(RuntimeDirError, match="symbolic link"):
        LookupClient(lookup_rpc_port=7101)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_dir_owned_by_another_user_is_refused(default_chain: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    default_chain.mkdir(mode=0o700)
    os.chown(default_chain, nobody, nobody)
    with pytest.raises(RuntimeDirError) as info:
        _serve()
    msg = str(info.value)
    assert f"{default_chain} is owned by uid {nobody}, not by this user (uid 0)" in msg
    assert "set KVPOOL_RUNTIME_DIR" in msg
    assert list(default_chain.iterdir()) == []


def test_group_writable_dir_is_refused(default_chain: Path) -> None:
    default_chain.mkdir()
    default_chain.chmod(0o770)
    with pytest.raises(RuntimeDirError) as info:
        _serve()
    msg = str(info.value)
    assert f"{default_chain} has mode 0770: group or others have access" in msg
    assert "chmod 700 it" in msg
    assert list(default_chain.iterdir()) == []
    assert _mode(default_chain) == 0o770  # not "fixed" behind the operator's back


def test_a_file_in_place_of_the_dir_is_refused(default_chain: Path) -> None:
    default_chain.write_text("x")
    with pytest.raises(RuntimeDirError, match=f"{default_chain} is not a directory"):
        runtime_dir()


def test_symlink_at_the_owner_file_is_refused_and_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = lookup_socket_path(7102)
    owner = Path(str(path) + ".owner")
    owner.symlink_to(victim)
    with pytest.raises(RuntimeDirError) as info:
        LookupServer(lambda h: 0, lookup_rpc_port=7102)
    assert f"{owner} is a symbolic link" in str(info.value) and "remove it" in str(info.value)
    assert victim.read_text() == "precious"
    assert owner.is_symlink() and not path.exists()


def test_dangling_symlink_at_the_owner_file_creates_nothing(tmp_path: Path) -> None:
    # A naive open(O_CREAT) would create the link's target: a file of the attacker's choosing.
    target = tmp_path / "created-through-link"
    owner = Path(str(lookup_socket_path(7103)) + ".owner")
    owner.symlink_to(target)
    with pytest.raises(RuntimeDirError, match="symbolic link"):
        LookupServer(lambda h: 0, lookup_rpc_port=7103)
    assert not target.exists()
    with pytest.raises(FileExistsError):
        create_private_file(owner, b"{}")
    assert not target.exists()


def test_stale_socket_cleanup_never_follows_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = lookup_socket_path(7104)
    path.symlink_to(victim)
    with pytest.raises(RuntimeDirError) as info:
        LookupServer(lambda h: 0, lookup_rpc_port=7104)
    assert f"{path} is a symbolic link" in str(info.value)
    assert victim.read_text() == "precious"
    assert path.is_symlink()
    # The refused server leaves no owner file behind to block the next start.
    assert not Path(str(path) + ".owner").exists()


def test_too_long_runtime_dir_is_a_clear_error_not_a_zmq_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(deep))
    for make in (lambda: LookupServer(lambda h: 0, lookup_rpc_port=7105),
                 lambda: LookupClient(lookup_rpc_port=7105)):
        with pytest.raises(RuntimeDirError) as info:
            make()
        msg = str(info.value)
        assert f"holds at most {SUN_PATH_MAX}" in msg and str(deep) in msg
        assert "set KVPOOL_RUNTIME_DIR to a shorter directory" in msg
    assert list(deep.iterdir()) == []


_HOLDER = """
import os, sys
from kvpool_connector.lookup import LookupServer
LookupServer(lambda h: 0, lookup_rpc_port=int(sys.argv[1]), engine_id="killed")
print("serving", flush=True)
sys.stdin.read()
"""


def test_release_if_dead_removes_what_a_killed_engine_left_and_keeps_a_live_ones(
        tmp_path: Path) -> None:
    """An engine SIGKILLed before its close leaves its socket and owner file (a name no engine
    takes again is never swept): ``release_if_dead`` removes them once the holder is gone,
    keeps a live holder's, and never follows a symbolic link."""
    path = lookup_socket_path(7105)
    owner = Path(str(path) + ".owner")
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, "7105"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "serving\n"
        assert path.exists() and owner.exists()
        assert release_if_dead(7105) is False  # alive: kept
        assert path.exists() and owner.exists()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
        child.wait()
    assert path.exists() and owner.exists()  # what a kill leaves
    assert release_if_dead(7105) is True
    assert not path.exists() and not owner.exists()
    assert release_if_dead(7105) is False  # nothing there
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path.symlink_to(victim)
    assert release_if_dead(7105) is False
    assert path.is_symlink() and victim.read_text() == "precious"
