"""What the scheduler knows of one request: one ``RequestRecord`` per request id, from vLLM's
first ask (``get_num_new_matched_tokens``) to ``request_finished`` (issue 37 item 4: it was
eleven dicts and sets, cleared in four places).

The phases (``Phase``) a request passes through, in vLLM V1's order of calls:

- ``ASKED``: looked up (or skipped); ``asked`` keeps the answer while the request waits for
  blocks, ``offered`` the load the answer offered;
- ``ALLOCATED``: vLLM allocated its blocks and its prompt is hashed (``hashes``);
- ``LOAD_CONFIRMED``: vLLM accepted the offered tokens (``confirmed``), not sent yet;
- ``LOAD_SENT``: an asynchronous load went to the workers before vLLM scheduled the request
  (``sent_tokens``; ``loading`` until its ``finished_recving``);
- ``RUNNING``: scheduled; ``running`` holds its block table and save progress.

A resumed (preempted) request is ``RUNNING`` and may have a load confirmed again. What outlives
the record (a load's outcome, saves a finished request still runs) is the scheduler's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from kvpool_connector.metadata import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "CachedLookup",
    "PendingLoad",
    "Phase",
    "RequestRecord",
    "Running",
    "has_media",
    "has_prompt_embeds",
    "record_of",
]


class Phase(Enum):
    """Where a request is in the scheduler's hands (module docstring)."""

    ASKED = "asked"
    ALLOCATED = "allocated"
    LOAD_CONFIRMED = "load_confirmed"
    LOAD_SENT = "load_sent"
    RUNNING = "running"


@dataclass
class Running:
    """A scheduled request: its prompt's chunk hashes, block ids and save progress;
    ``save_limit``: leading chunks its admission policy lets it save; ``saved_states``: the
    ``(group, chunk)`` Mamba states already sent to the workers."""

    hashes: list[str]
    block_ids: list[int]
    saved_chunks: int = 0
    group_block_ids: tuple[list[int], ...] = ()
    save_limit: int = 0
    saved_states: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class PendingLoad:
    """A confirmed load not yet sent to the workers."""

    spec: LoadSpec
    hashes: list[str]
    block_ids: list[int] = field(default_factory=list)
    group_block_ids: tuple[list[int], ...] = ()


@dataclass
class CachedLookup:
    """A request's last lookup: valid while its token count and local hit are unchanged (and
    the pool's leases on the keys last)."""

    num_tokens: int
    local_tokens: int
    answer: tuple[int, bool]
    spec: LoadSpec | None


@dataclass
class RequestRecord:
    """Everything the scheduler keeps of one request vLLM still knows (module docstring).

    Attributes:
        phase: where the request is; set by the scheduler as it moves on.
        asked: the last lookup's answer, while the request waits for blocks.
        offered: the load that answer offered, until vLLM allocates (or asks again).
        hashes: the prompt's chunk hashes (none for media or prompt embeddings).
        confirmed: the load vLLM accepted, until it goes to the workers.
        sent_tokens: pool tokens of an asynchronous load sent before the request was
            scheduled (0: none), taken when it is.
        loading: an asynchronous load the workers may still be writing into its blocks.
        running: its block table and save progress, once scheduled.
        saving: a save was scheduled for it (its blocks are kept at its end).

    The data fields are not exclusive: a resumed (preempted) request is ``RUNNING`` with a load
    confirmed again, and a lookup keeps the prompt's hashes before vLLM allocates.
    """

    phase: Phase = Phase.ASKED
    asked: CachedLookup | None = None
    offered: LoadSpec | None = None
    hashes: list[str] | None = None
    confirmed: PendingLoad | None = None
    sent_tokens: int = 0
    loading: bool = False
    running: Running | None = None
    saving: bool = False


def record_of(records: dict[str, RequestRecord], rid: str) -> RequestRecord:
    """``rid``'s record in ``records``, made on first use."""
    rec = records.get(rid)
    if rec is None:
        rec = records[rid] = RequestRecord()
    return rec


def has_media(request: Request) -> bool:
    """Whether the request carries media (vLLM's ``mm_features``): its placeholder tokens are
    the same for every image, so they cannot key its KV (issue 11 item 3)."""
    return bool(getattr(request, "mm_features", None))


def has_prompt_embeds(request: Request) -> bool:
    """Whether the request carries prompt embeddings (vLLM ``--enable-prompt-embeds``): its
    token ids do not say which embeddings the model saw (issue 39 item 3)."""
    return getattr(request, "prompt_embeds", None) is not None
