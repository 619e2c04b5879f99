"""The pool key grammar: batch-built keys equal the ``PoolKey`` strings, flush size groups
drop only the chunk hash of a key, and keys of two layout digests never meet."""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import sys
import threading
import time
import tracemalloc
from array import array
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool_agent.pool_listing import KEY_RE, size_group
from kvpool_connector._chunk_hash import prefixed_keys, sha256_chain, token_bytes
from kvpool_connector.keys import (
    ALL_KEYS_PATTERN,
    ChunkHashCache,
    HashAlgo,
    ParallelLayout,
    PoolKey,
    chunk_hashes,
    chunk_keys,
    layout_pattern,
    model_pattern,
    normalize_model_name,
    probe_key,
    shard_prefix,
)

MODEL = normalize_model_name("org/Model@v2 ")
DIGEST, OTHER_DIGEST = "0123456789ab", "ba9876543210"
HASHES = chunk_hashes(list(range(64)), 16)
LAYOUTS = [ParallelLayout(tp, 0, dcp, 0, 1) for tp in range(2) for dcp in range(2)]


def test_key_strings_follow_the_documented_grammar() -> None:
    key = PoolKey(MODEL, DIGEST, ParallelLayout(3, 1, 2, 4, 5), HASHES[0])
    assert MODEL == "org/Model%40v2"
    assert str(key) == f"kvpool@org/Model%40v2@0123456789ab@tp3.pcp1.dcp2.pp4.g5@{HASHES[0]}"
    assert str(key.layer(7)) == f"{key}@L7"
    assert len(HASHES) == 4 and all(re.fullmatch(r"[0-9a-f]{32}", h) for h in HASHES)


@pytest.mark.parametrize(("model", "name"), [
    # A local directory is named, not located: the same weights elsewhere share a name
    # (which weights they are is the layout digest's fingerprint).
    ("/models/llama-3-8b", "llama-3-8b"),
    ("/nfs//llama-3-8b/", "llama-3-8b"),
    ("./llama-3-8b", "llama-3-8b"),
    ("~/models/llama 3", "llama%203"),
    # A hub cache snapshot by its repo id, a hub id as it is.
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/"
     "0123456789abcdef0123456789abcdef01234567", "Qwen/Qwen3-0.6B"),
    ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
    ("org/Model@v2 ", "org/Model%40v2"),
])
def test_model_names_say_which_model_not_where(model: str, name: str) -> None:
    assert normalize_model_name(model) == name
    assert normalize_model_name(name) == name  # a name normalises to itself
    assert re.search(model_pattern(model), str(PoolKey(name, DIGEST, ParallelLayout(), HASHES[0])))


@pytest.mark.parametrize("model", ["", " / ", "/", "./"])
def test_an_empty_model_name_is_refused(model: str) -> None:
    with pytest.raises(ValueError, match="model name is empty"):
        normalize_model_name(model)


@pytest.mark.parametrize("layers", [None, [0, 1, 2]])
@pytest.mark.parametrize("n_layouts", [1, 4])
def test_chunk_keys_equal_pool_key_strings_chunk_major(
        layers: list[int] | None, n_layouts: int) -> None:
    layouts = LAYOUTS[:n_layouts]
    got = chunk_keys([shard_prefix(MODEL, DIGEST, lay) for lay in layouts], HASHES, layers)
    want = [
        str(PoolKey(MODEL, DIGEST, lay, h)) if i is None
        else str(PoolKey(MODEL, DIGEST, lay, h).layer(i))
        for h in HASHES for lay in layouts for i in (layers or [None])
    ]
    assert got == want
    per_chunk = n_layouts * len(layers or [None])
    assert len(got) == len(HASHES) * per_chunk
    # Chunk i's keys are one contiguous slice, all carrying hash i.
    assert all(HASHES[1] in k for k in got[per_chunk : 2 * per_chunk])
    assert chunk_keys([shard_prefix(MODEL, DIGEST, LAYOUTS[0])], [], layers) == []


@pytest.mark.parametrize("other", [
    "kvpool-probe@0123",                                                 # probe namespace
    "other@m@0123456789ab@tp0.pcp0.dcp0.pp0.g0@" + "0" * 32,             # another tenant
    "kvpool@m@0123456789ab@tp0.pcp0.dcp0.pp0.g0@" + "0" * 31,            # short hash
    "kvpool@m@0123456789ab@tp0.pcp0.dcp0.pp0.g0@" + "0" * 32 + "@Lx",    # bad layer
    "kvpool@m@0123456789ab@tp0.pcp0.dcp0.g0@" + "0" * 32,                # layout without pp
    "kvpool@m@tp0.pcp0.dcp0.pp0.g0@" + "0" * 32,                         # no digest (old)
    "kvpool@m@0123456789AB@tp0.pcp0.dcp0.pp0.g0@" + "0" * 32,            # digest not lower hex
])
def test_strings_outside_the_grammar_are_their_own_size_group(other: str) -> None:
    assert size_group(other) == other


def test_every_key_built_is_a_key_to_the_agents_listing() -> None:
    """The agent states the key's shape for its listings (``pool_listing.KEY_RE``: it cannot
    import the connector): every key the connector builds matches it."""
    for layout in LAYOUTS:
        key = PoolKey(MODEL, DIGEST, layout, HASHES[0])
        assert KEY_RE.fullmatch(str(key)) and KEY_RE.fullmatch(str(key.layer(17)))


def test_size_group_drops_only_the_chunk_hash() -> None:
    a, b = (PoolKey(MODEL, DIGEST, LAYOUTS[1], h) for h in HASHES[:2])
    assert size_group(str(a)) == size_group(str(b)) == shard_prefix(MODEL, DIGEST, LAYOUTS[1])
    assert size_group(str(a.layer(3))) == size_group(str(b.layer(3)))
    assert size_group(str(a.layer(3))) != size_group(str(a.layer(4)))
    assert size_group(str(a)) != size_group(str(PoolKey(MODEL, DIGEST, LAYOUTS[2], HASHES[0])))
    # Values of another layout have another size: their own group.
    assert size_group(str(a)) != size_group(str(PoolKey(MODEL, OTHER_DIGEST, LAYOUTS[1],
                                                         HASHES[0])))
    assert size_group("kvpool-probe@x") == "kvpool-probe@x"


def test_scope_patterns_select_model_and_shard() -> None:
    key = str(PoolKey(MODEL, DIGEST, LAYOUTS[3], HASHES[0]))
    other = str(PoolKey(MODEL, OTHER_DIGEST, LAYOUTS[3], HASHES[0]))
    # ``model`` covers every layout digest of the model, ``layout`` only its own digest.
    assert re.search(model_pattern("org/Model@v2"), key)
    assert re.search(model_pattern("org/Model@v2"), other)
    assert not re.search(model_pattern("org/Model"), key)
    assert re.search(layout_pattern("org/Model@v2", DIGEST, LAYOUTS[3]), key + "@L0")
    assert not re.search(layout_pattern("org/Model@v2", DIGEST, LAYOUTS[3]), other)
    assert not re.search(layout_pattern("org/Model@v2", DIGEST, LAYOUTS[2]), key)
    # Every KV-cache group of the shard (a hybrid model's), and no other shard's.
    for group in (0, 1, 12):
        grouped = str(PoolKey(MODEL, DIGEST, replace(LAYOUTS[3], group=group), HASHES[0]))
        assert re.search(layout_pattern("org/Model@v2", DIGEST, LAYOUTS[3]), grouped)
        assert not re.search(layout_pattern("org/Model@v2", DIGEST, LAYOUTS[2]), grouped)
    # Several shards (a worker's KV-head shares): each of them, no other.
    two = layout_pattern("org/Model@v2", DIGEST, LAYOUTS[2], LAYOUTS[3])
    assert re.search(two, key) and re.search(two, str(PoolKey(MODEL, DIGEST, LAYOUTS[2],
                                                               HASHES[0])))
    assert not any(re.search(two, str(PoolKey(MODEL, DIGEST, x, HASHES[0])))
                   for x in LAYOUTS if x not in (LAYOUTS[2], LAYOUTS[3]))
    with pytest.raises(ValueError, match="at least one ParallelLayout"):
        layout_pattern("org/Model@v2", DIGEST)


def test_keys_of_two_digests_never_collide() -> None:
    layers = [0, 1]
    mine = chunk_keys([shard_prefix(MODEL, DIGEST, lay) for lay in LAYOUTS], HASHES, layers)
    theirs = chunk_keys([shard_prefix(MODEL, OTHER_DIGEST, lay) for lay in LAYOUTS], HASHES,
                        layers)
    assert len(set(mine)) == len(mine) and not set(mine) & set(theirs)
    assert not set(chunk_keys([shard_prefix(MODEL, DIGEST, LAYOUTS[0])], HASHES)) & set(
        chunk_keys([shard_prefix(MODEL, OTHER_DIGEST, LAYOUTS[0])], HASHES))


@pytest.mark.parametrize("bad", ["", "0123456789a", "0123456789abc", "0123456789AB",
                                 "0123456789a@", "zzzzzzzzzzzz"])
def test_a_digest_outside_the_grammar_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="12 lower-case hex digits"):
        shard_prefix(MODEL, bad, LAYOUTS[0])


def test_probe_keys_are_fresh_and_outside_every_kv_scope() -> None:
    a, b = probe_key("engine-1/dp0.tp0.pp0"), probe_key("engine-1/dp0.tp0.pp0")
    assert a != b
    assert a.startswith("kvpool-probe@engine-1/dp0.tp0.pp0@") and len(a.rsplit("@", 1)[1]) == 12
    assert probe_key().startswith("kvpool-probe@") and probe_key().count("@") == 1
    for pattern in (ALL_KEYS_PATTERN, model_pattern("engine-1")):
        assert re.search(pattern, a) is None


def test_chunk_hashes_are_pinned_chained_and_salted() -> None:
    """Scheme 2 (chained SHA-256 by default, XXH3-128 opt-in): the same hashes in every process
    and release; a change here changes every key, so it must come with a ``LAYOUT_SCHEME``
    bump."""
    assert chunk_hashes(list(range(32)), 16) == [
        "61c55c61d07d3525bc655c50acd4cf4f", "fba04066e03cc88c51f4f06314e77e29"]
    # Any sequence of token ids (vLLM hands lists; tuples take another conversion path).
    assert chunk_hashes(tuple(range(33)), 16) == chunk_hashes(list(range(32)), 16)
    assert chunk_hashes(list(range(32)), 16, b"salt=x") == [
        "f20c764c4684da8841cd2e000de0ba42", "d1e3464b928a18bd6b29a1de1e254280"]
    assert chunk_hashes(list(range(32)), 16, algo="xxh3_128") == [
        "5804cf1095b59e19799b8004d0b4f230", "62cc1985df5d4ef6ed93c9288bb13e0c"]
    assert chunk_hashes(list(range(32)), 16, b"salt=x", algo="xxh3_128") == [
        "399a6faa58949f21989983c8a1de3771", "ed440d4aeff172ea68aeccb8f8295b28"]
    with pytest.raises(ValueError, match="hash_algo must be one of sha256, xxh3_128"):
        chunk_hashes(list(range(32)), 16, algo="md5")  # type: ignore[arg-type]
    # Chained: the second chunk's hash depends on the first chunk's tokens; a partial chunk
    # gets none.
    assert chunk_hashes([99, *range(1, 32)], 16)[1] != chunk_hashes(list(range(32)), 16)[1]
    assert len(chunk_hashes(list(range(47)), 16)) == 2


def _hashlib_chain(data: bytes, step: int, parent: bytes) -> tuple[list[str], bytes]:
    """The reference the C loop must equal: one ``hashlib.sha256`` per whole chunk."""
    values = []
    for start in range(0, len(data) // step * step, step):
        parent = hashlib.sha256(parent + data[start : start + step]).digest()
        values.append(parent)
    return [v[:16].hex() for v in values], b"".join(values)


@given(data=st.binary(max_size=600), step=st.integers(1, 130),
       parent=st.binary(max_size=40), view=st.booleans())
def test_the_c_chain_equals_hashlib_chunk_by_chunk(
        data: bytes, step: int, parent: bytes, view: bool) -> None:
    """Any bytes, chunk size and parent (a trailing partial chunk is not hashed; a
    memoryview reads as its bytes)."""
    arg = memoryview(bytearray(data))[:] if view else data
    assert sha256_chain(arg, step, parent) == _hashlib_chain(data, step, parent)


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), cut=st.integers(0, 80),
       as_tuple=st.booleans())
def test_token_bytes_equal_array_uint32_little_endian(
        ids: list[int], cut: int, as_tuple: bool) -> None:
    count = min(cut, len(ids))
    want = array("I", ids[:count])
    if sys.byteorder == "big":
        want.byteswap()
    assert token_bytes(tuple(ids) if as_tuple else ids, count) == want.tobytes()


def test_token_bytes_refuse_ids_outside_uint32_and_take_index_types() -> None:
    with pytest.raises(OverflowError, match=r"token id -1 at position 1 is outside \[0, 2\*\*32\)"):
        token_bytes([5, -1], 2)
    with pytest.raises(OverflowError, match=r"token id 4294967296 at position 0"):
        token_bytes([2**32], 1)
    with pytest.raises(OverflowError, match=r"token id at position 0 .*: at least 2\*\*63"):
        token_bytes([2**64], 1)
    with pytest.raises(TypeError):
        token_bytes([1.5], 1)
    with pytest.raises(TypeError, match="token ids must be a sequence of int"):
        token_bytes(7, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"count must be in \[0, 2\], got 3"):
        token_bytes([1, 2], 3)
    # Only the first ``count`` ids are read: a bad id past them is no error.
    assert token_bytes([1, -1], 1) == b"\x01\x00\x00\x00"
    # An id whose __index__ empties the list: an error, never a read past its end.
    ids: list[object] = [1, 2, 3, 4]

    class Shrinks:
        def __index__(self) -> int:
            ids.clear()
            return 9

    ids[1] = Shrinks()
    with pytest.raises(RuntimeError, match="token ids changed size while being packed"):
        token_bytes(ids, 4)  # type: ignore[arg-type]
    # numpy's integers (``__index__``) and bools pack as their value, as with array("I").
    assert token_bytes([np.uint32(258), np.int64(7), True], 3) == (
        b"\x02\x01\x00\x00\x07\x00\x00\x00\x01\x00\x00\x00")


def test_token_bytes_overflow_is_an_overflow_error_whatever_the_id() -> None:
    """Every id outside [0, 2**32) is the documented OverflowError: the message never turns
    the id into text through its ``repr`` (a Python int of more than 4,300 digits refuses
    that with ValueError, an ``__index__`` object's ``__repr__`` may raise anything)."""
    with pytest.raises(OverflowError,
                       match=r"token id at position 1 is outside \[0, 2\*\*32\): at least 2\*\*63"):
        token_bytes([0, 10**5000], 2)
    with pytest.raises(OverflowError, match=r"token id at position 0 .*: below -2\*\*63"):
        token_bytes([-(10**5000)], 1)
    with pytest.raises(OverflowError, match=r"token id 9223372036854775807 at position 0"):
        token_bytes([2**63 - 1], 1)

    class Unprintable:
        def __index__(self) -> int:
            return 2**40

        def __repr__(self) -> str:
            raise KeyError("no repr")

    with pytest.raises(OverflowError, match=r"token id 1099511627776 at position 0 is outside"):
        token_bytes([Unprintable()], 1)  # type: ignore[list-item]


class _Str(str):
    pass


_TEXT = st.text(alphabet=st.sampled_from("az09@%./\u00e9\u4e2d\U0001f600"), max_size=6)


@given(prefixes=st.lists(_TEXT, max_size=3), names=st.lists(_TEXT, max_size=5),
       suffixes=st.none() | st.lists(_TEXT, max_size=3), subclass=st.booleans())
def test_prefixed_keys_equal_the_comprehension(
        prefixes: list[str], names: list[str], suffixes: list[str] | None,
        subclass: bool) -> None:
    """ASCII (the fast copy), other text and str subclasses (through concatenation); lists,
    tuples or any sequence."""
    if subclass:
        names = [_Str(n) for n in names]
    want = [p + n + s for n in names for p in prefixes
            for s in ([""] if suffixes is None else suffixes)]
    got = prefixed_keys(tuple(prefixes), iter(names), suffixes)  # type: ignore[arg-type]
    assert got == want and all(type(k) is str for k in got)


def test_prefixed_keys_refuse_what_is_not_str() -> None:
    with pytest.raises(TypeError, match="names must be str, got bytes"):
        prefixed_keys(["p@"], ["ab", b"cd"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="prefixes must be str, got int"):
        prefixed_keys([1], ["ab"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="suffixes must be str, got NoneType"):
        prefixed_keys(["p@"], ["ab"], [None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="names must be a sequence of str"):
        prefixed_keys(["p@"], 5)  # type: ignore[arg-type]


def test_a_missing_c_extension_names_the_fix() -> None:
    """Not built (or built from an older source): the import says what to run."""
    code = ("import sys; sys.modules['kvpool_connector._chunk_hash'] = None; "
            "import kvpool_connector.keys")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvpool's C extension kvpool_connector._chunk_hash is "
                           "missing or out of date"), last
    assert "run `make setup`" in last and "libssl-dev" in last


def test_the_c_chain_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="step must be > 0, got 0"):
        sha256_chain(b"abcd", 0, b"")
    with pytest.raises(ValueError, match="step must be > 0, got -4"):
        sha256_chain(b"abcd", -4, b"")
    with pytest.raises(TypeError):
        sha256_chain("text", 4, b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sha256_chain(b"abcd", 4)  # type: ignore[call-arg]
    assert sha256_chain(b"", 4, b"root") == ([], b"")


def test_the_c_chain_lets_other_threads_run_on_a_long_input() -> None:
    """From 1 MiB on, the hashing runs with the GIL released, so an engine's other threads
    are not held up: a Python thread ticks while the chain is well under way. (Were the GIL
    held, no tick could land between 10 ms after the call began and 10 ms before it ended:
    the ticker gets the GIL at most once per 5 ms switch interval before the C loop starts.)"""
    data = bytes(range(256)) * (1 << 19)  # 128 MiB: 120-180 ms of SHA-256 here
    ticks: list[float] = []
    calling, stop = threading.Event(), threading.Event()

    def tick() -> None:
        calling.wait()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        calling.set()
        start = time.perf_counter()
        names, _ = sha256_chain(data, 1 << 16, b"")
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
    assert len(names) == 2048
    assert end - start > 0.03, "the input hashed too fast to tell"
    assert any(start + 0.01 < t < end - 0.01 for t in ticks)


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_chunk_hash_cache_gives_exactly_chunk_hashes(algo: HashAlgo) -> None:
    """Repeated, extended, truncated, edited, salted and unrelated prompts: the cache answers
    exactly ``chunk_hashes`` every time, reuses a shared prefix and stays within its bound."""
    rng = random.Random(7)
    cache = ChunkHashCache(4, algo, max_tokens=300)
    base = [rng.randrange(40) for _ in range(120)]
    for step in range(300):
        kind = step % 5
        if kind == 0:
            prompt = base[: rng.randrange(len(base) + 1)]
        elif kind == 1:
            prompt = base + [rng.randrange(40) for _ in range(rng.randrange(30))]
        elif kind == 2:
            prompt = list(base)
            prompt[rng.randrange(len(prompt))] += 1  # one token differs
        elif kind == 3:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(50))]
        else:
            prompt = list(base)
        extra = rng.choice([b"", b"salt=a", b"salt=b"])
        want = chunk_hashes(prompt, 4, extra, algo)
        got = cache.hashes(prompt, extra)
        assert got == want, (step, kind)
        got.append("caller's list")  # the caller owns the returned list
        assert cache.hashes(prompt, extra) == want
        if 8 <= len(prompt) < 200 and rng.random() < 0.3:
            base = prompt
    assert cache.reused_chunks > cache.hashed_chunks > 0
    assert len(cache) > 0 and cache._tokens <= 300


def test_chunk_hash_cache_reuses_a_prefix_and_keeps_salts_apart() -> None:
    cache = ChunkHashCache(16)
    turn1 = list(range(100, 164))  # 4 chunks
    assert cache.hashes(turn1) == chunk_hashes(turn1, 16)
    assert (cache.reused_chunks, cache.hashed_chunks) == (0, 4)
    turn2 = [*turn1, *range(7, 39)]  # the next turn of the conversation: 2 new chunks
    assert cache.hashes(turn2) == chunk_hashes(turn2, 16)
    assert (cache.reused_chunks, cache.hashed_chunks) == (4, 6)
    edited = [*turn1[:40], 1, *turn1[41:]]  # differs in chunk 2: chunks 0-1 reused
    assert cache.hashes(edited) == chunk_hashes(edited, 16)
    assert (cache.reused_chunks, cache.hashed_chunks) == (6, 8)
    # Another salt shares nothing with the unsalted prompt.
    assert cache.hashes(turn1, b"salt=x") == chunk_hashes(turn1, 16, b"salt=x")
    assert (cache.reused_chunks, cache.hashed_chunks) == (6, 12)
    assert cache.hashes(list(range(15))) == []
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        ChunkHashCache(16, max_tokens=-1)
    cache.clear()
    assert len(cache) == 0


def test_chunk_hash_cache_holds_no_copy_of_a_long_salt() -> None:
    """``cache_salt`` is the client's choice, of any length: 32 requests with distinct 1 MiB
    salts and one-chunk prompts leave the cache holding a few KiB, not 32 MiB (it kept each
    salt as part of its key); the hashes stay those of ``chunk_hashes``."""
    cache = ChunkHashCache(16)
    prompt = list(range(16))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(32):
            salt = bytes([i]) * (1 << 20)
            assert cache.hashes(prompt, salt) == chunk_hashes(prompt, 16, salt)
            del salt
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) == 32 and held < 64 * 1024
