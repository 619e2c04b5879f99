"""What an agent key's file name binds it to (issue 42): an engine (``ENGINE.engine.key``), a
pool (``NAME@POOL.pool.key``), both, or neither (a fleet-wide key), read from the key's
``AllowList.name`` (``agent/<file stem>``); and whether a report is the key's to send
(``bound_elsewhere``). Re-exported by ``kvpool_agent.auth``, which writes and reads the files."""

from __future__ import annotations

from urllib.parse import quote, unquote

from kvpool_agent.protocol import Source

__all__ = [
    "ENGINE_KEY_SUFFIX",
    "POOL_KEY_SUFFIX",
    "binding_rank",
    "bound_elsewhere",
    "bound_engine",
    "bound_pool",
    "pool_file_part",
]

ENGINE_KEY_SUFFIX = ".engine"
"""An agent key named ``authorized_keys/agent/<engine id>.engine.key`` reports only for that
engine; any other name is a fleet-wide agent key."""

POOL_KEY_SUFFIX = ".pool"
"""An agent key named ``authorized_keys/agent/<label>@<pool>.pool.key`` reports only for that
pool (``Source.master``, quoted by ``pool_file_part``); ``<label>`` is ``<engine id>.engine``
for a key bound to an engine too, else any name."""


def pool_file_part(pool: str) -> str:
    """``pool`` (a ``Source.master``) as it appears in a pool-bound key's file name: quoted,
    ``:`` and ``,`` kept (``127.0.0.1:50051``; ``etcd://h:2379`` is ``etcd:%2F%2Fh:2379``)."""
    return quote(pool, safe=":,")


def _label_and_pool(key_name: str) -> tuple[str, str | None]:
    """``(label, pool)`` of an ``AllowList.name`` (``agent/LABEL@POOL.pool``); ``pool`` is
    ``None`` for a key not bound to a pool, whose label is the whole file stem. A stem ending
    in ``.pool`` without ``@`` is all pool (a hand-copied ``POOL.pool.key`` binds, never lifts)."""
    stem = key_name.rpartition("/")[2]
    if not stem.endswith(POOL_KEY_SUFFIX) or len(stem) == len(POOL_KEY_SUFFIX):
        return stem, None
    label, _, quoted = stem[: -len(POOL_KEY_SUFFIX)].rpartition("@")
    return label, unquote(quoted)


def bound_engine(key_name: str) -> str | None:
    """The engine id an agent key may report for, from its ``AllowList.name``
    (``agent/prefill-0.engine`` or ``agent/prefill-0.engine@10.0.0.1:50051.pool`` ->
    ``prefill-0``); ``None``: a key for any engine."""
    stem = _label_and_pool(key_name)[0]
    if stem.endswith(ENGINE_KEY_SUFFIX) and len(stem) > len(ENGINE_KEY_SUFFIX):
        return stem[: -len(ENGINE_KEY_SUFFIX)]
    return None


def bound_pool(key_name: str) -> str | None:
    """The pool (``Source.master``) an agent key may report for, from its ``AllowList.name``
    (``agent/p0.engine@10.0.0.1:50051.pool`` -> ``10.0.0.1:50051``); ``None``: a key for any
    pool."""
    return _label_and_pool(key_name)[1]


def binding_rank(key_name: str) -> int:
    """How much a name binds its key (engine, pool: one each); ``AllowList`` keeps the most
    binding of a key's names."""
    return (bound_engine(key_name) is not None) + (bound_pool(key_name) is not None)


def bound_elsewhere(key_name: str, src: Source) -> str | None:
    """Why a report of agent ``src`` from key ``key_name`` is not the key's to send, when the
    key is bound to one pool (``bound_pool``: ``src.master`` must be it) or one engine
    (``bound_engine``), else ``None``.

    The agent id counts too: it must be the engine id or ``<engine id>/<one part>``
    (``Source``'s forms), else a bound key could hold another engine's agent id (commands sent
    to that id would reach it, and that engine's own agent would be refused).

    The reason's kind (before its ``:``) is what the hub counts it as
    (``HubCounters.count_report_refused``): ``pool:`` a report for another pool than the key's
    (``pool_binding_refused``: a misconfigured or borrowed key, not a fight over an id),
    ``takeover:`` one for another engine or one of its ids (``takeover_refused``)."""
    pool = bound_pool(key_name)
    if pool is not None and pool != src.master:
        return (f"pool: key {key_name} is bound to pool {pool[:80]!r}; report for pool "
                f"{src.master[:80]!r} dropped")
    engine = bound_engine(key_name)
    if engine is None:
        return None
    if engine != src.engine_id:
        return (f"takeover: key {key_name} is bound to engine {engine!r}; report for "
                f"{src.engine_id!r} dropped")
    head, _, tail = src.agent_id.partition(engine + "/")
    if src.agent_id != engine and (head or not tail or "/" in tail):
        return (f"takeover: key {key_name} is bound to engine {engine!r}; agent id "
                f"{src.agent_id!r} is not one of its agents; report dropped")
    return None
