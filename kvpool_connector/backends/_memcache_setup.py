"""Everything before a MemCache store exists: its settings, the Ascend driver check and the
time-limited ``init`` probe.

The Ascend driver. ``init`` builds the memory pool through MemFabric's ``hybm``, which reads
the driver version from ``<driver install path>/driver/version.info`` (the path comes from
``/etc/ascend_install.info``, default ``/usr/local/Ascend``) and gives up with "the current
version of ascend driver does not support mf!" when it is missing. Before that it connects to
the meta service's config store and, if none answers, retries for minutes. So the backend
first checks the driver file itself (``ascend_driver_problem``); without it, it still runs the
real ``setup`` + ``init`` - in a child process with a time limit (``memcache_init_timeout_s``,
``probe_init``), and only when the config store accepts connections (``reachable``).

Configuration (``kv_connector_extra_config``, ``memcache_<field>``; environment variables
``MEMCACHE_META_SERVICE_URL``, ``MEMCACHE_CONFIG_STORE_URL``, ``MEMCACHE_METRICS_URL``
override): ``meta_service_url``, ``config_store_url`` (``tcp://host:port``, as in
``mmc-local.conf``), ``metrics_url`` (``http://host:port``), ``protocol`` (``host_rdma``,
``host_tcp``, ``host_shm``, ``device_rdma``, ``device_sdma``...), ``dram_size`` /
``hbm_size`` (``"1GB"``, ``"0"``), ``device_id``, ``world_size``, ``buffer_location``
(``host``/``device``), ``init_timeout_s``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kvpool_connector._validation import field_problems

__all__ = ["MemcacheConfig", "ascend_driver_problem", "probe_init", "reachable"]

_INSTALL_INFO = Path("/etc/ascend_install.info")
_DEFAULT_ASCEND = Path("/usr/local/Ascend")


class MemcacheConfig(BaseModel):
    """Validated client settings (see the module docstring for each field)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    meta_service_url: str = "tcp://127.0.0.1:5000"
    config_store_url: str = "tcp://127.0.0.1:6000"
    metrics_url: str | None = None
    protocol: Literal[
        "host_rdma", "host_tcp", "host_shm", "host_urma",
        "device_rdma", "device_sdma", "device_urma", "device_uboe",
    ] = "host_rdma"
    dram_size: str = "1GB"
    hbm_size: str = "0"
    device_id: int = 0
    world_size: int = 256
    buffer_location: Literal["host", "device"] = "host"
    init_timeout_s: float = 30.0

    @field_validator("meta_service_url", "config_store_url")
    @classmethod
    def _tcp(cls, v: str) -> str:
        u = urlparse(v)
        if u.scheme != "tcp" or not u.hostname or not u.port:
            raise ValueError(f"{v!r} is not tcp://host:port (e.g. 'tcp://127.0.0.1:5000')")
        return v

    @field_validator("metrics_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and urlparse(v).scheme not in ("http", "https"):
            raise ValueError(f"{v!r} is not http://host:port (the meta service's metrics_url)")
        return v.rstrip("/") if v else v

    @classmethod
    def load(cls, extra_config: dict[str, Any] | None = None) -> MemcacheConfig:
        """Settings from ``kv_connector_extra_config`` (``memcache_*`` keys) and the
        ``MEMCACHE_*_URL`` environment variables (which win).

        Raises:
            ValueError: a bad field; the message names the ``kv_connector_extra_config`` key.
        """
        extra = dict(extra_config or {})
        raw = {n: extra[f"memcache_{n}"] for n in cls.model_fields if f"memcache_{n}" in extra}
        for name in ("meta_service_url", "config_store_url", "metrics_url"):
            env = os.environ.get(f"MEMCACHE_{name.upper()}")
            if env:
                raw[name] = env
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = field_problems(exc, "kv_connector_extra_config.memcache_")
            raise ValueError(f"bad memcache config: {problems}") from None

    def local_config(self) -> Any:
        """The package's ``LocalConfig`` for ``DistributedObjectStore.setup``."""
        from memcache_hybrid import LocalConfig

        cfg = LocalConfig()
        cfg.meta_service_url = self.meta_service_url
        cfg.config_store_url = self.config_store_url
        cfg.protocol = self.protocol
        cfg.dram_size = self.dram_size
        cfg.hbm_size = self.hbm_size
        cfg.world_size = self.world_size
        return cfg


def ascend_driver_problem(install_info: Path = _INSTALL_INFO) -> str | None:
    """Why MemFabric cannot find the Ascend driver here, or ``None`` if it can.

    Mirrors what ``hybm`` reads: ``Driver_Install_Path_Param`` in ``install_info`` (else
    ``/usr/local/Ascend``), then ``<that>/driver/version.info``, which must name a version."""
    base = _DEFAULT_ASCEND
    try:
        for line in install_info.read_text().splitlines():
            if line.startswith("Driver_Install_Path_Param="):
                base = Path(line.split("=", 1)[1].strip())
    except OSError:
        pass
    version = base / "driver" / "version.info"
    try:
        if "Version=" in version.read_text():
            return None
        return f"{version} names no driver version"
    except OSError:
        return f"{version} not found (no Ascend NPU driver installed on this host)"


def reachable(url: str, timeout_s: float = 1.0) -> bool:
    """True if ``url`` (``tcp://host:port``) accepts a TCP connection within ``timeout_s``."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "", u.port or 0), timeout=timeout_s):
            return True
    except OSError:
        return False


_LOG_ERROR = re.compile(r"\bERROR \[[^\]]*\]\s*(?:\[[^\]]*\]\s*)?(.*)$")


def probe_init(config: MemcacheConfig) -> tuple[int | None, list[str]]:
    """Run the real ``DistributedObjectStore().setup(...)`` + ``init(device_id)`` in a child
    process, killed after ``config.init_timeout_s`` seconds.

    Returns ``(rc, errors)``: ``init``'s return code (``None`` if it did not return in time)
    and the ``ERROR`` lines the package logged, oldest first, without repeats."""
    args = json.dumps(config.model_dump())
    root = str(Path(__file__).resolve().parents[2])  # the child imports this package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool_connector.backends._memcache_setup", args],
            capture_output=True, text=True, timeout=config.init_timeout_s, env=env,
        )
        output, rc_text = proc.stdout + proc.stderr, proc.stdout
    except subprocess.TimeoutExpired as exc:
        raw = (exc.stdout or b"") + (exc.stderr or b"")
        output = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        rc_text = ""
    found = re.search(r"^KVPOOL_INIT_RC=(-?\d+)$", rc_text, re.M)
    errors: list[str] = []
    for line in output.splitlines():
        m = _LOG_ERROR.search(line)
        if m and m.group(1).strip() not in errors:
            errors.append(m.group(1).strip())
    return (int(found.group(1)) if found else None), errors


def _child_init(args: str) -> None:
    """Child side of ``probe_init``: the real package's ``setup`` + ``init``."""
    from memcache_hybrid import DistributedObjectStore

    cfg = MemcacheConfig.model_validate(json.loads(args))
    store = DistributedObjectStore()
    rc = store.setup(cfg.local_config())
    if rc == 0:
        rc = store.init(cfg.device_id)
    print(f"KVPOOL_INIT_RC={rc}", flush=True)


if __name__ == "__main__":
    _child_init(sys.argv[1])


if __name__ == "__main__":
    _child_init(sys.argv[1])
