"""A stand-in engine for triage tests: a real process with a real agent reporting to a hub.

``python standin_engine.py HUB ENGINE_ID HOST PORT MASTER`` starts ``kvpool_agent.start_agent``
with the ``Source`` facts a connector reports (``process_facts``: start time, log file = its
redirected stdout, ``PORT`` as the port it needs, the master), then binds ``PORT`` on
127.0.0.1 and logs a line per step. When ``PORT`` is taken it logs the error and exits 1
(after its agent reported, as an engine failing at start-up would).
"""

from __future__ import annotations

import socket
import sys
import time

from kvpool_agent import start_agent
from kvpool_agent.process_facts import process_facts
from kvpool_agent.protocol import Source


def main() -> int:
    hub, engine_id, host, port, master = sys.argv[1:6]
    source = Source(agent_id=f"{engine_id}/scheduler", engine_id=engine_id,
                    instance_role="mixed", kv_role="kv_both", process_role="replay",
                    pid=__import__("os").getpid(), host=host, backend="mooncake",
                    model="standin", **process_facts(ports=[int(port)], master=master))
    agent = start_agent(source, address=hub)
    print(f"engine {engine_id} started, agent reporting to {hub}", flush=True)
    while agent.counters.get("sent", 0) < 1:
        time.sleep(0.02)
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", int(port)))
    except OSError as e:
        print(f"cannot bind port {port}: {e}", flush=True)
        time.sleep(0.5)  # a few more reports reach the hub before the process is gone
        agent.stop()
        return 1
    sock.listen()
    print(f"listening on port {port}", flush=True)
    step = 0
    while True:
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
