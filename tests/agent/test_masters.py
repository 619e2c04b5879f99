"""``probe_master``: a master's ``/health`` as the wire's ``MasterView``, its reason when down,
and an odd answer that still makes a valid report (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from kvpool_agent.masters import probe_master
from kvpool_agent.protocol import MAX_COUNT, MAX_ID_CHARS, MasterView
from kvpool_replay import LocalMooncakeMaster, free_port


def _over_the_wire(view: MasterView) -> MasterView:
    """``view`` encoded as an agent sends it and decoded with the schema's checks."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(view), type=MasterView)


def test_an_unreachable_master_says_why_and_the_reason_crosses_the_wire() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    view = probe_master(url, timeout_s=2.0)
    assert (view.admin_url, view.reachable, view.serving) == (url, False, False)
    assert view.error and "\n" not in view.error
    assert _over_the_wire(view).error == view.error


def test_a_running_master_answers_without_error(mooncake_master: LocalMooncakeMaster) -> None:
    view = probe_master(mooncake_master.admin_url, timeout_s=5.0)
    assert view.reachable and view.error == ""
    # A master without --enable_ha answers as a serving leader of its one-master pool.
    assert (view.role, view.ha_state, view.serving) == ("leader", "serving", True)
    assert _over_the_wire(view) == view


@pytest.fixture
def odd_master() -> Iterator[str]:
    """A /health that answers a leader with control characters, an over-long address and a
    view version past the schema's bound."""
    body = json.dumps({"role": "leader\x1b[2J", "ha_state": "serving", "service_ready": True,
                       "leader_address": "x" * (MAX_ID_CHARS + 50),
                       "view_version": MAX_COUNT * 4}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_odd_answer_is_clipped_to_a_valid_report(odd_master: str) -> None:
    view = probe_master(odd_master, timeout_s=5.0)
    assert view.reachable
    # The escape is not a leader's role, so the master is not taken for a serving leader.
    assert view.role == "leader?[2J" and not view.serving
    assert len(view.leader_address) == MAX_ID_CHARS
    assert view.view_version == MAX_COUNT - 1
    assert _over_the_wire(view) == view
