"""KV events for routers (``kvpool_connector._events``): the scheduler's join of the workers'
``ChunkWritten`` reports with vLLM's block hashes, on real vLLM ``Request`` objects hashed by
vLLM's own block hasher. The end-to-end test with vLLM's ZMQ publisher is in
``tests/vllm/test_vllm_events.py``."""

from __future__ import annotations

import pickle

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvpool_connector._events import ChunkWritten, KVPoolKVEvents, PoolEventJoiner, PoolFlushed

BLOCK = 16


def _request(rid: str, token_ids: list[int]) -> Request:
    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=token_ids,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def _ext(req: Request) -> list[object]:
    """The request's block hashes as vLLM's events carry them (``maybe_convert_block_hash``)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def _written(rid: str, chunk: int, shard: str, shards: int = 2, group: int = 0
             ) -> ChunkWritten:
    return ChunkWritten(req_id=rid, chunk=chunk, shard=shard, shards=shards, group=group)


def test_each_kv_cache_group_is_announced_and_removed_on_its_own() -> None:
    req = _request("h", list(range(300, 300 + 4 * BLOCK)))
    joiner = PoolEventJoiner(medium="mooncake", chunk_size=2 * BLOCK, hash_block_size=BLOCK)
    joiner.track(req)
    # One shard; chunk 0 of groups 0 and 3 (a hybrid model's window and full groups).
    joiner.add([_written("h", 0, "tp0", 1, group=0), _written("h", 0, "tp0", 1, group=3),
                _written("h", 0, "tp0", 1, group=3)])
    stored = joiner.take()
    assert [(type(e).__name__, e.group_idx, e.block_hashes) for e in stored] == [
        ("BlockStored", 0, _ext(req)[0:2]), ("BlockStored", 3, _ext(req)[0:2])]
    joiner.flushed()
    removed = joiner.take()
    assert [(type(e).__name__, e.group_idx, e.block_hashes) for e in removed] == [
        ("BlockRemoved", 0, _ext(req)[0:2]), ("BlockRemoved", 3, _ext(req)[0:2])]


def test_a_chunk_is_announced_once_every_shard_wrote_it() -> None:
    req = _request("r", list(range(100, 100 + 5 * BLOCK)))
    assert len(req.block_hashes) == 5
    joiner = PoolEventJoiner(medium="mooncake", chunk_size=2 * BLOCK, hash_block_size=BLOCK)
    joiner.track(req)
    # tp0 reports chunks 0 and 1 in one step, tp1 chunk 1 in the next, then chunk 0.
    joiner.add([_written("r", 0, "tp0"), _written("r", 1, "tp0")])
    assert joiner.take() == []
    joiner.add([_written("r", 1, "tp1")])
    (second,) = joiner.take()
    joiner.add([_written("r", 0, "tp1"), _written("r", 0, "tp1")])
    (first,) = joiner.take()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == _ext(req)[0:2]
    assert first.parent_block_hash is None
    assert first.token_ids == list(range(100, 100 + 2 * BLOCK))
    assert second.block_hashes == _ext(req)[2:4]
    assert second.parent_block_hash == _ext(req)[1]
    assert second.token_ids == list(range(100 + 2 * BLOCK, 100 + 4 * BLOCK))
    assert (first.block_size, first.medium, first.group_idx, first.lora_id) == (
        BLOCK, "mooncake", 0, None)
    # A flush removes both chunks' blocks, once.
    joiner.add([PoolFlushed(scope="engine")])
    (removed,) = joiner.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == "mooncake"
    assert removed.block_hashes == _ext(req)[2:4] + _ext(req)[0:2]
    joiner.flushed()
    assert joiner.take() == []


def test_released_and_unknown_requests_announce_nothing() -> None:
    req = _request("r", list(range(3 * BLOCK)))
    joiner = PoolEventJoiner(medium="m", chunk_size=BLOCK, hash_block_size=BLOCK)
    joiner.track(req)
    joiner.add([_written("r", 0, "tp0")])
    joiner.release(["r"])
    joiner.add([_written("r", 0, "tp1"), _written("ghost", 0, "tp0", shards=1)])
    assert joiner.take() == []
    # Reports of unknown requests leave nothing behind.
    joiner.add([_written("ghost", 1, "tp0")])
    assert joiner._partial == {}


def test_remembered_chunks_are_bounded() -> None:
    req = _request("r", list(range(4 * BLOCK)))
    joiner = PoolEventJoiner(medium="m", chunk_size=BLOCK, hash_block_size=BLOCK, remember=2)
    joiner.track(req)
    joiner.add([_written("r", c, "tp0", shards=1) for c in range(4)])
    assert len(joiner.take()) == 4
    joiner.flushed()
    (removed,) = joiner.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == _ext(req)[2:4]


def test_container_merges_like_vllms_aggregator() -> None:
    a = KVPoolKVEvents([_written("r", 0, "tp0")])
    # With several workers vLLM pickles each worker's output through its message queue.
    b = pickle.loads(pickle.dumps(KVPoolKVEvents([_written("r", 0, "tp1")])))
    a.add_events(b.get_all_events())
    a.increment_workers(1)
    assert a.aggregate() is a and a.get_number_of_workers() == 2
    assert [e.shard for e in a.get_all_events() if isinstance(e, ChunkWritten)] == ["tp0", "tp1"]
    a.clear_events()
    assert a.get_all_events() == [] and a.get_number_of_workers() == 1


def test_chunk_must_be_whole_hash_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's hash block size"):
        PoolEventJoiner(medium="m", chunk_size=24, hash_block_size=16)


def test_a_chunk_two_requests_wrote_is_announced_once() -> None:
    tokens = list(range(2 * BLOCK))
    a, b = _request("a", tokens), _request("b", tokens + [7] * BLOCK)
    joiner = PoolEventJoiner(medium="m", chunk_size=BLOCK, hash_block_size=BLOCK)
    joiner.track(a)
    joiner.track(b)
    joiner.add([_written(r, c, "tp0", shards=1) for r in ("a", "b") for c in range(2)])
    assert [e.token_ids for e in joiner.take() if isinstance(e, BlockStored)] == [
        tokens[:BLOCK], tokens[BLOCK:]]
    joiner.add([_written("b", 2, "tp0", shards=1)])
    (third,) = joiner.take()
    assert isinstance(third, BlockStored) and third.parent_block_hash == _ext(b)[1]
