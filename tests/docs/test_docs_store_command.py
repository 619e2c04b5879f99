"""docs/deployment.md's ``mooncake_client`` store command: the flags ``kvpool_replay``'s
``LocalPoolStore`` runs the store with (no more, no fewer), each one the installed
``mooncake_client`` knows, and, run as written with this host's addresses, a store whose segment
the master counts."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore
from kvpool_replay._processes import engine_env, free_port, stop_process_tree, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
HEADING = "### Start a store process: `mooncake_client`"
SEGMENT = 64 << 20


def _documented() -> list[str]:
    """The documented command's arguments after ``mooncake_client`` (its first ``bash``
    block under ``HEADING``; comments dropped, continuation lines joined)."""
    section = DOC.read_text().split(HEADING, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if not ln.lstrip().startswith("#")]
    argv = shlex.split(" ".join(lines).replace("\\ ", " "))
    assert argv[0] == "mooncake_client", argv
    return argv[1:]


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--"))


def test_the_documented_store_command_is_local_pool_stores_and_mounts(tmp_path: Path) -> None:
    documented = _flags(_documented())
    binary = shutil.which("mooncake_client", path=engine_env()["PATH"])
    assert binary is not None
    known = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60,
                           check=False).stdout
    for name in documented:
        assert f"-{name} (" in known, f"--{name}: not a flag of {binary}"
    with LocalMooncakeMaster(log_dir=tmp_path / "master") as master:
        with LocalPoolStore(master, SEGMENT, log_dir=tmp_path) as store:
            assert store.proc is not None
            ran = _flags([str(a) for a in store.proc.args][1:])  # type: ignore[union-attr]
        assert documented.keys() == ran.keys()
        for same in ("metadata_server", "protocol", "local_buffer_size"):
            assert documented[same] == ran[same], same
    # A fresh master: the stopped store's segment stays listed for client_ttl (10 s).
    with LocalMooncakeMaster(log_dir=tmp_path / "master2") as master:
        argv = [binary, *(f"--{k}={v}" for k, v in (documented | {
            "master_server_address": master.address, "host": "127.0.0.1",
            "port": str(free_port()), "global_segment_size": "64MB"}).items())]
        log = (tmp_path / "documented.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env(),
                                start_new_session=True)
        try:
            mounted = wait_until(
                lambda: proc.poll() is None
                and fetch_mooncake_stats(master.admin_url).total_bytes == SEGMENT, 30)
            assert mounted, (tmp_path / "documented.log").read_text(errors="replace")[-2000:]
        finally:
            stop_process_tree(proc, timeout_s=5)
            log.close()
