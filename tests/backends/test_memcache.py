"""MemcacheBackend. The real ``memcache_hybrid`` meta service runs here (it needs no NPU), the
real client ``init`` fails for want of the Ascend driver and must become a clear "needs Ascend
driver" health error. The data path runs against a stand-in store whose method names and
signatures are checked against the installed package, so the stand-in cannot drift."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import memcache_hybrid
import pytest

from kvpool_connector.backends.base import BackendError, BackendUnavailable
from kvpool_connector.backends.memcache import (
    MemcacheBackend,
    MemcacheConfig,
    ascend_driver_problem,
    mmc_code,
)
from kvpool_replay import free_port

NO_DRIVER = ascend_driver_problem() is not None

_META = """
import sys
import memcache_hybrid as m
cfg = m.MetaConfig()
cfg.config_store_url, cfg.meta_service_url, cfg.metrics_url, cfg.log_path = sys.argv[1:5]
cfg.log_output_target = "file"
assert m.MetaService.setup(cfg) == 0
m.MetaService.main()
"""


@pytest.fixture(scope="module")
def meta_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real MemCache meta service (``MetaService.main`` of the installed package) on free
    127.0.0.1 ports; yields the ``memcache_*`` extra-config keys pointing at it."""
    urls = {
        "memcache_config_store_url": f"tcp://127.0.0.1:{free_port()}",
        "memcache_meta_service_url": f"tcp://127.0.0.1:{free_port()}",
        "memcache_metrics_url": f"http://127.0.0.1:{free_port()}",
    }
    log_dir = tmp_path_factory.mktemp("mmc-meta")
    proc = subprocess.Popen(
        [sys.executable, "-c", _META, urls["memcache_config_store_url"],
         urls["memcache_meta_service_url"], urls["memcache_metrics_url"], str(log_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"{urls['memcache_metrics_url']}/health", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "meta service failed"
            time.sleep(0.1)
        yield urls
    finally:
        proc.kill()  # it traps SIGTERM and keeps running
        proc.wait()


@pytest.mark.skipif(not NO_DRIVER, reason="this host has an Ascend driver")
def test_real_init_without_driver_becomes_clear_health_error(
        meta_service: dict[str, str]) -> None:
    config = {**meta_service, "memcache_protocol": "host_tcp", "memcache_dram_size": "32MB",
              "memcache_init_timeout_s": 30}
    t0 = time.monotonic()
    checks = MemcacheBackend.check(config)
    assert [c.name for c in checks] == ["ascend_driver", "config_store", "client_init"]
    driver, store, init = checks
    assert not driver.ok and "memcache needs Ascend driver" in driver.detail
    assert "version.info" in driver.detail
    assert store.ok
    # The real package ran, returned -1 and said why, in its own words.
    assert not init.ok and init.code == -1
    assert "needs Ascend driver" in init.detail
    assert "ascend driver does not support mf" in init.detail
    assert time.monotonic() - t0 < 20


@pytest.mark.skipif(not NO_DRIVER, reason="this host has an Ascend driver")
def test_without_meta_service_fails_fast_instead_of_retrying_for_minutes() -> None:
    config = {"memcache_config_store_url": f"tcp://127.0.0.1:{free_port()}"}
    t0 = time.monotonic()
    checks = MemcacheBackend.check(config)
    assert [(c.name, c.ok) for c in checks] == [("ascend_driver", False), ("config_store", False)]
    assert "unreachable" in checks[1].detail
    with pytest.raises(BackendUnavailable, match=r"config_store: .*unreachable"):
        MemcacheBackend.from_config(config)
    assert time.monotonic() - t0 < 15  # init's reconnects take minutes


def test_config_errors_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"memcache_meta_service_url: .*tcp://host:port"):
        MemcacheConfig.load({"memcache_meta_service_url": "127.0.0.1:5000"})
    with pytest.raises(ValueError, match="memcache_protocol"):
        MemcacheConfig.load({"memcache_protocol": "udp"})
    with pytest.raises(ValueError, match="memcache_metrics_url"):
        MemcacheConfig.load({"memcache_metrics_url": "tcp://x:1"})
    monkeypatch.setenv("MEMCACHE_CONFIG_STORE_URL", "tcp://10.0.0.1:6000")
    cfg = MemcacheConfig.load({"memcache_config_store_url": "tcp://127.0.0.1:1"})
    assert cfg.config_store_url == "tcp://10.0.0.1:6000"
    assert MemcacheBackend.check({"memcache_protocol": "udp"})[0].name == "config"


class _Info:
    """``KeyInfo`` as the stand-in answers it: only ``size()`` is used."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class StandInStore:
    """In-memory ``DistributedObjectStore`` with the real method names and signatures (see
    ``test_stand_in_matches_the_installed_package``): copies bytes by address like the real
    G2H/H2G paths and answers MemCache's own codes."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.data: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.directs: list[int] = []
        self.closed = 0

    def _registered(self, addr: int, size: int) -> bool:
        return any(a <= addr and addr + size <= a + n for a, n in self.registered)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if buffer_ptr == 0 or size <= 0:
            return -3000
        self.registered.append((buffer_ptr, size))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.data else 0 for k in keys]

    def batch_put_from_layers(self, keys: list[str], buffer_ptrs: list[list[int]],
                              sizes: list[list[int]], direct: int = 3,
                              replicateConfig: Any = None) -> list[int]:
        self.directs.append(direct)
        out = []
        for k, ptrs, szs in zip(keys, buffer_ptrs, sizes, strict=True):
            if not all(self._registered(p, n) for p, n in zip(ptrs, szs, strict=True)):
                out.append(-3000)
                continue
            blob = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, szs, strict=True))
            if sum(map(len, self.data.values())) + len(blob) > self.capacity:
                out.append(-3016)  # MMC_NOT_ENOUGH_MEMORY
                continue
            self.data[k] = blob
            out.append(0)
        return out

    def batch_get_into_layers(self, keys: list[str], buffer_ptrs: list[list[int]],
                              sizes: list[list[int]], direct: int = 2) -> list[int]:
        self.directs.append(direct)
        out = []
        for k, ptrs, szs in zip(keys, buffer_ptrs, sizes, strict=True):
            blob = self.data.get(k)
            if blob is None:
                out.append(-3007)  # MMC_OBJECT_NOT_EXISTS
                continue
            if len(blob) != sum(szs):
                out.append(-3000)
                continue
            off = 0
            for p, n in zip(ptrs, szs, strict=True):
                ctypes.memmove(p, blob[off:off + n], n)
                off += n
            out.append(0)
        return out

    def batch_get_key_info(self, keys: list[str], flag: int = 1) -> list[_Info]:
        return [_Info(len(self.data.get(k, b""))) for k in keys]

    def remove_batch(self, arg0: list[str]) -> list[int]:
        return [0 if self.data.pop(k, None) is not None else -3007 for k in arg0]

    def close(self) -> int:
        self.closed += 1
        return 0


def _params(doc: str) -> list[tuple[str, str | None]]:
    """(name, default) of a pybind11 signature line ``name(self: T, a: T, b: T = 3) -> R``."""
    inner = doc.split("(", 1)[1].rsplit(") ->", 1)[0]
    out = []
    for part in re.split(r", (?=\w+: )", inner):
        name, _, rest = part.partition(":")
        default = rest.split(" = ", 1)[1].strip() if " = " in rest else None
        if name != "self":
            out.append((name.strip(), default))
    return out


@pytest.mark.parametrize("method", [
    "register_buffer", "batch_is_exist", "batch_put_from_layers", "batch_get_into_layers",
    "batch_get_key_info", "remove_batch", "close"])
def test_stand_in_matches_the_installed_package(method: str) -> None:
    import inspect

    real = _params(getattr(memcache_hybrid.DistributedObjectStore, method).__doc__.strip())
    stand_in = inspect.signature(getattr(StandInStore, method))
    mine = [(p.name, p.default) for p in stand_in.parameters.values() if p.name != "self"]
    assert [n for n, _ in mine] == [n for n, _ in real]
    for (_, mine_default), (_, real_default) in zip(mine, real, strict=True):
        if real_default is None:
            assert mine_default is inspect.Parameter.empty
        elif real_default.lstrip("-").isdigit():
            assert mine_default == int(real_default)


def blocks(n: int, size: int) -> list[ctypes.Array[ctypes.c_char]]:
    return [ctypes.create_string_buffer(bytes((i * 7 + j) % 256 for j in range(size)), size)
            for i in range(n)]


@pytest.fixture
def pair() -> tuple[MemcacheBackend, StandInStore]:
    store = StandInStore()
    return MemcacheBackend(MemcacheConfig(), store), store


def test_layers_round_trip_and_codes(pair: tuple[MemcacheBackend, StandInStore]) -> None:
    backend, store = pair
    src, dst = blocks(6, 512), [ctypes.create_string_buffer(512) for _ in range(6)]
    for b in src + dst:
        backend.register_buffer(ctypes.addressof(b), 512)
    addr = [ctypes.addressof(b) for b in src]
    # Two keys, each the concatenation of three "layers".
    assert backend.batch_put_from(["k0", "k1"], [addr[0:3], addr[3:6]],
                                  [[512] * 3, [512] * 3]) == [0, 0]
    assert backend.batch_exists(["k0", "k1", "nope"]) == [1, 1, 0]
    daddr = [ctypes.addressof(b) for b in dst]
    assert backend.batch_get_into(["k1", "k0", "nope"], [daddr[0:3], daddr[3:6], daddr[0:1]],
                                  [[512] * 3, [512] * 3, [512]]) == [1536, 1536, -704]
    assert [d.raw for d in dst] == [s.raw for s in src[3:6] + src[0:3]]
    assert store.directs == [3, 2]  # H2G to put, G2H to get: host buffers
    # Unregistered memory is refused per key, a full pool is NO_AVAILABLE_HANDLE.
    stray = ctypes.create_string_buffer(64)
    assert backend.batch_put_from(["x"], [[ctypes.addressof(stray)]], [[64]]) == [-600]
    big = ctypes.create_string_buffer(1 << 20)
    backend.register_buffer(ctypes.addressof(big), 1 << 20)
    assert backend.batch_put_from(["big"], [[ctypes.addressof(big)]], [[1 << 20]]) == [-200]
    with pytest.raises(BackendError) as err:
        backend.register_buffer(0, 64)
    assert err.value.code == -600


def test_device_buffers_use_l2g_and_g2l() -> None:
    store = StandInStore()
    backend = MemcacheBackend(MemcacheConfig(buffer_location="device"), store)
    buf = ctypes.create_string_buffer(b"abc", 3)
    backend.register_buffer(ctypes.addressof(buf), 3)
    assert backend.batch_put_from(["d"], [[ctypes.addressof(buf)]], [[3]]) == [0]
    assert backend.batch_get_into(["d"], [[ctypes.addressof(buf)]], [[3]]) == [3]
    assert store.directs == [0, 1]


def test_failing_binding_never_raises_and_close_is_final(
        pair: tuple[MemcacheBackend, StandInStore]) -> None:
    backend, store = pair

    def boom(*_: object) -> list[int]:
        raise TypeError("incompatible function arguments")

    store.batch_is_exist = boom  # type: ignore[method-assign]
    store.batch_get_into_layers = boom  # type: ignore[method-assign]
    assert backend.batch_exists(["a", "b"]) == [-1, -1]
    assert backend.batch_get_into(["a"], [[1]], [[1]]) == [-1]
    backend.close()
    backend.close()
    assert store.closed == 1
    assert backend.batch_put_from(["a"], [[1]], [[1]]) == [-1010]


def test_mmc_codes_map_to_mooncake_names() -> None:
    assert [mmc_code(c) for c in (0, -3007, -3102, -3016, -3013, -3106, -3104, -3017, -3000,
                                  -1, -9999)] == [
        0, -704, -704, -200, -200, -707, -706, -900, -600, -1, -1]


def test_stats_health_and_scope_from_the_real_meta_service(
        meta_service: dict[str, str]) -> None:
    cfg = MemcacheConfig.load(meta_service)
    backend = MemcacheBackend(cfg, StandInStore())
    stats = backend.stats()
    assert stats.backend == "memcache" and stats.healthy is True
    # No local service could join without a driver: the real pool is empty.
    assert (stats.keys, stats.used_bytes, stats.total_bytes) == (0, 0, 0)
    health = backend.health()
    assert [(c.name, c.ok) for c in health] == [("client", True), ("meta_service", True)]
    assert health[1].detail.startswith("HTTP 200 ")
    assert backend.remove_by_scope("^kvpool@", dry_run=True).keys == 0
    no_url = MemcacheBackend(MemcacheConfig(), StandInStore())
    with pytest.raises(BackendError, match="memcache_metrics_url"):
        no_url.remove_by_scope("^kvpool@", dry_run=True)
    assert no_url.stats().health_detail == "memcache_metrics_url not set"


def test_with_driver_an_unreachable_config_store_fails_fast(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host with the driver, a missing meta service must not cost init's minutes of
    reconnects: from_config refuses before calling init."""
    import kvpool_connector.backends.memcache as mc

    monkeypatch.setattr(mc, "ascend_driver_problem", lambda *_: None)
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match="memcache_config_store_url") as err:
        MemcacheBackend.from_config(
            {"memcache_config_store_url": f"tcp://127.0.0.1:{free_port()}"})
    assert err.value.code == -900
    assert time.monotonic() - t0 < 10  # init's reconnects take minutes
