"""The hub's state file: which key has held each engine id since when (its tenure), so
pool-wide commands keep their targets across a hub restart (``kvpool_agent._fleet``).

A small JSON file, written atomically (a temporary file renamed over it, mode 0600): engine id
-> [identity, since ms, last seen ms]. Tenures of engines unheard for ``TENURE_KEPT_S`` are not
loaded again (and are pruned from memory: ``Fleet.prune_tenure``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgspec

from kvpool_agent._fleet import Fleet

__all__ = ["TENURE_KEPT_S", "StateFile"]

log = logging.getLogger("kvpool.hub")

TENURE_KEPT_S = 7 * 86400.0
"""Tenures of engines not heard from this long (s) are dropped."""


class _HubState(msgspec.Struct):
    """The hub's state file: engine id -> [identity, since ms, last seen ms]."""

    tenure: dict[str, tuple[str, float, float]] = msgspec.field(default_factory=dict)


class StateFile:
    """Load and save ``fleet``'s tenures at ``path`` (``None``: in memory only)."""

    def __init__(self, path: Path | None, fleet: Fleet) -> None:
        self.path = path
        self._fleet = fleet
        self._warned = False

    def load(self) -> None:
        """Tenures from the file (a missing file: none; an unreadable one is logged and
        ignored: the hub starts, flush targets fall back to the longest connected)."""
        if self.path is None:
            return
        try:
            data = msgspec.json.decode(self.path.read_bytes(), type=_HubState)
        except FileNotFoundError:
            return
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("kvpool hub: state file %s ignored: %s", self.path, e)
            return
        cutoff = time.time() * 1e3 - TENURE_KEPT_S * 1e3
        self._fleet.load_tenure({e: t for e, t in data.tenure.items() if t[2] >= cutoff})

    def save(self) -> None:
        """Write the tenures atomically; a failure is logged once and the hub goes on."""
        if self.path is None:
            return
        body = msgspec.json.encode(_HubState(tenure=self._fleet.tenure()))
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("kvpool hub: cannot write state file %s (%s): flush targets are "
                            "not kept across a restart", self.path, e)
            tmp.unlink(missing_ok=True)
