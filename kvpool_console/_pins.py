"""What ``pin`` / ``unpin`` / ``pins`` send and what their answers say, for both the one-shot
modes (``kvpool_console._pin_cli``) and the TUI's pin and unpin dialogs
(``kvpool_console.screens._pins``): one builder of ``PinArgs`` checked as the hub and agents
check them, so both refuse the same bad input with the same line (naming the field as the
operator gave it: ``--tokens`` on the command line, ``token ids`` in the dialog), and one
wording of each result.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from kvpool_agent.protocol import (
    MAX_PIN_TEXT_CHARS,
    MAX_PIN_TOKENS,
    MAX_SOFT_PIN_TTL_MS,
    CommandReply,
    EngineState,
    PinArgs,
)
from kvpool_console.model import fmt_bytes

__all__ = ["CLI_FIELDS", "DEFAULT_TTL_S", "PIN_TIMEOUT_MS", "TUI_FIELDS", "PinInputError",
           "chunk_size_of", "done_line", "parse_ttl_s", "pin_args", "pins_summary",
           "worker_models"]

PIN_TIMEOUT_MS = 30_000
"""How long ``pin`` / ``unpin`` wait for the workers (ms): an unpin waits out readers' leases."""

DEFAULT_TTL_S = 1800.0
"""A soft pin's TTL unless the operator gives one (s)."""

CLI_FIELDS: Mapping[str, str] = {"model": "--model", "pin_id": "--id", "token_ids": "--tokens",
                                 "text": "--text", "ttl_ms": "--ttl-s", "mode": "--mode"}
"""``PinArgs`` field -> the command-line option that sets it (named in a bad-input line)."""

TUI_FIELDS: Mapping[str, str] = {"model": "model", "pin_id": "pin id",
                                 "token_ids": "token ids", "text": "text", "ttl_ms": "TTL (s)",
                                 "mode": "mode"}
"""``PinArgs`` field -> the pin dialog's label of it."""


class PinInputError(ValueError):
    """Bad pin input: the message is one line naming the field (as the operator gave it)
    and the fix."""


def _token_ids(text: str, name: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise PinInputError(f"{name}: no token ids; give them comma-separated, "
                            "e.g. 1,15043,29892")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise PinInputError(f"{name}: {text[:40]!r} is not comma-separated integers; "
                            "e.g. 1,15043,29892") from None
    if any(not 0 <= t < 2**32 for t in ids):
        raise PinInputError(f"{name}: token ids are integers in 0..4294967295")
    if len(ids) > MAX_PIN_TOKENS:
        raise PinInputError(f"{name}: {len(ids)} token ids, at most {MAX_PIN_TOKENS} per pin")
    return ids


def parse_ttl_s(text: str, names: Mapping[str, str] = TUI_FIELDS) -> float:
    """A TTL typed as text (the dialog's field), in seconds.

    Raises:
        PinInputError: not a number.
    """
    try:
        return float(text.strip())
    except ValueError:
        raise PinInputError(f"{names['ttl_ms']}: {text[:20]!r} is not a number of seconds; "
                            f"e.g. {DEFAULT_TTL_S:g}") from None


def pin_args(command: Literal["pin", "unpin", "pins"], model: str, *,
             tokens: str | None = None, text: str | None = None, chat_template: bool = False,
             pin_id: str = "", mode: str = "soft", ttl_s: float = DEFAULT_TTL_S,
             names: Mapping[str, str] = CLI_FIELDS, chunk_size: int = 0) -> PinArgs:
    """The ``PinArgs`` of one command, checked as the hub and agents check them.

    Args:
        command: ``pin`` reads the prefix (``tokens``: comma-separated token ids, or
            ``text`` with ``chat_template``), ``mode`` and ``ttl_s`` (seconds, soft pins);
            ``unpin`` needs ``pin_id``; ``pins`` only ``model`` (empty: every model's).
        pin_id: the pin's name; a pin without one is named ``p-`` and a digest of the prefix.
        names: how each ``PinArgs`` field is named in a bad-input line (``CLI_FIELDS``,
            ``TUI_FIELDS``).
        chunk_size: the model's chunk size in tokens (``chunk_size_of``; 0: unknown): token
            ids fewer than it hold no whole chunk, so nothing to pin (the agents say so too,
            after a round trip; a text prefix is tokenized there).

    Raises:
        PinInputError: a value is invalid (one line naming its field and the fix).
    """
    fields: dict[str, Any] = {"model": model, "pin_id": pin_id}
    if command == "pin":
        if text is not None:
            if not text:
                raise PinInputError(f"{names['text']}: empty; give the prefix's text")
            if len(text) > MAX_PIN_TEXT_CHARS:
                raise PinInputError(f"{names['text']}: {len(text)} characters, at most "
                                    f"{MAX_PIN_TEXT_CHARS} per pin")
            fields.update(text=text, chat_template=chat_template)
            seed = text.encode()
        else:
            fields["token_ids"] = _token_ids(tokens or "", names["token_ids"])
            seed = ",".join(map(str, fields["token_ids"])).encode()
        if not 0 < ttl_s * 1e3 <= MAX_SOFT_PIN_TTL_MS:
            raise PinInputError(f"{names['ttl_ms']}: {ttl_s:g} s; give 0 < S <= "
                                f"{MAX_SOFT_PIN_TTL_MS // 1000} (Mooncake's max_kv_soft_pin_ttl)")
        n = len(fields.get("token_ids", ()))
        if 0 < n < chunk_size:
            raise PinInputError(f"{names['token_ids']}: {n} tokens hold no whole chunk of "
                                f"{chunk_size} (the model's chunk_size): give at least "
                                f"{chunk_size} token ids")
        fields.update(mode=mode, ttl_ms=max(1, round(ttl_s * 1e3)))
        fields["pin_id"] = pin_id or f"p-{hashlib.sha256(seed).hexdigest()[:12]}"
    elif command == "unpin" and not pin_id:
        raise PinInputError(f"{names['pin_id']}: empty; give the pin's name (see pins)")
    try:
        return msgspec.convert(fields, PinArgs)
    except msgspec.ValidationError as e:
        field = str(e).rpartition("$.")[2].split("[")[0]
        raise PinInputError(f"{names.get(field, field)}: {str(e).split(' - at ')[0]}; "
                            "ids are one word of letters, digits and _.:/@+=~- not starting "
                            "with -") from None


def chunk_size_of(states: Mapping[str, EngineState], model: str) -> int:
    """The smallest chunk size (tokens) ``model``'s workers report (``Source.layout``); 0
    when none does."""
    sizes = [int(v) for s in states.values()
             if s.source.process_role == "worker" and s.source.model == model
             and (v := str(s.source.layout.get("chunk_size", ""))).isdigit()]
    return min((n for n in sizes if n > 0), default=0)


def worker_models(states: Mapping[str, EngineState]) -> set[str]:
    """The models worker agents report (the models a pin can name)."""
    return {s.source.model for s in states.values()
            if s.source.process_role == "worker" and s.source.model}


def done_line(command: str, r: CommandReply) -> str:
    """What one worker did for ``pin`` or ``unpin`` (``r`` ok, with its ``pins``), in one line:
    the numbers the audit line has."""
    res = r.pins
    assert res is not None and res.pin is not None
    p = res.pin
    where = f"{p.model} layout {p.layout_digest} ({r.agent_id})"
    if command == "unpin":
        return (f"unpinned {p.pin_id!r} of {where}: {res.removed_keys} of {p.keys} keys "
                f"removed; pins of this layout now {fmt_bytes(res.pinned_bytes)}")
    kind = "hard" if p.mode == "hard" else f"soft, TTL {p.ttl_ms / 1e3:g} s"
    line = (f"pinned {p.pin_id!r} of {where}, {kind}: {p.tokens} tokens, {p.keys} keys "
            f"({fmt_bytes(p.bytes)}): {res.pinned_now} in the pool now, {res.pending} pinned "
            f"when saved; pins of this layout {fmt_bytes(res.pinned_bytes)} of the pool's "
            f"{fmt_bytes(res.pool_bytes)}")
    if res.failed:
        line += f"; {res.failed} keys the store refused"
    return line


def pins_summary(model: str, replies: list[CommandReply]) -> str:
    """One line of ``pins`` replies (the TUI's events log): every pin, then each failure."""
    held = [f"{p.pin_id} ({p.model} layout {p.layout_digest}, {p.mode}, {p.tokens} tokens, "
            f"{fmt_bytes(p.bytes)})"
            for r in replies if r.ok and r.pins is not None for p in r.pins.pins]
    line = f"pins of {model or 'every model'}: " + (", ".join(held) or "none")
    failed = [f"{r.agent_id}: {r.error}" for r in replies if not r.ok]
    return line + ("; failed: " + "; ".join(failed) if failed else "")
