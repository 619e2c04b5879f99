"""Rules on ports: services of one host that share a port, and P/D side-channel ports inside the
range Mooncake's Ascend Direct Transport binds."""

from __future__ import annotations

from collections.abc import Iterable

from kvpool_config.rules._finding import Finding

__all__ = [
    "ASCEND_DEFAULT_BASE_PORT",
    "ASCEND_PORTS_PER_DEVICE",
    "DEFAULT_DEVICES_PER_HOST",
    "ascend_port_window",
    "check_duplicate_ports",
    "check_kv_port_in_ascend_window",
]

ASCEND_DEFAULT_BASE_PORT = 20_000
"""First port of the Ascend Direct Transport listen windows when ``ASCEND_BASE_PORT`` is unset
(Mooncake ``ascend_direct_transport.h``: ``int32_t base_port_ = 20000``)."""

ASCEND_PORTS_PER_DEVICE = 100
"""Width of each physical NPU's listen window (Mooncake ``ascend_direct_transport/utils.cpp``:
``kPortRange = 100``; ``FindAdxlListenPort`` binds a random port in
``[base + dev * 100, base + (dev + 1) * 100]``)."""

DEFAULT_DEVICES_PER_HOST = 16
"""NPUs per host assumed when ``p_pod_npu_num`` / ``d_pod_npu_num`` is not given (Atlas 800 A3)."""


def ascend_port_window(base_port: int, devices: int) -> tuple[int, int]:
    """Inclusive port range Ascend Direct Transport may bind on a host with ``devices`` NPUs:
    ``[base, base + devices * 100]`` (see :data:`ASCEND_PORTS_PER_DEVICE`)."""
    return base_port, base_port + devices * ASCEND_PORTS_PER_DEVICE


def check_kv_port_in_ascend_window(
    kv_port: int, *, base_port: int | None, devices: int | None, path: str
) -> Finding | None:
    """A ``kv_port`` inside the Ascend Direct Transport listen range can collide: each NPU's
    transfer engine binds a random free port in its window (Mooncake ``FindAdxlListenPort``),
    so the connector's side channel on ``kv_port`` may find it taken, or take the engine's."""
    base = ASCEND_DEFAULT_BASE_PORT if base_port is None else base_port
    ndev = devices if devices else DEFAULT_DEVICES_PER_HOST
    low, high = ascend_port_window(base, ndev)
    if not low <= kv_port <= high:
        return None
    device = (kv_port - base) // ASCEND_PORTS_PER_DEVICE
    base_text = (
        f"ASCEND_BASE_PORT {base}" if base_port is not None else f"ASCEND_BASE_PORT unset -> {base}"
    )
    return Finding(
        "warning",
        "ascend-port-window",
        path,
        f"kv_port {kv_port} lies in the Ascend Direct Transport listen range {low}-{high} "
        f"({base_text}, {ASCEND_PORTS_PER_DEVICE} ports per NPU, {ndev} NPUs; NPU {device}'s "
        "window): the transfer engine binds a random free port there, so the two can collide "
        "at start-up",
        f"move kv_port outside {low}-{high} (e.g. {high + 1000}) or set ASCEND_BASE_PORT so "
        "the range starts above it",
    )


def check_duplicate_ports(entries: Iterable[tuple[int, str, str]]) -> list[Finding]:
    """No two services of one host/pod share a port. ``entries`` are ``(port, path, what)``;
    one error per later use of a port already taken."""
    seen: dict[int, tuple[str, str]] = {}
    out: list[Finding] = []
    for port, path, what in entries:
        if port in seen:
            first_path, first_what = seen[port]
            out.append(
                Finding(
                    "error",
                    "port-conflict",
                    path,
                    f"{what} uses port {port}, already used by {first_what} ({first_path})",
                    "give each service its own port",
                )
            )
        else:
            seen[port] = (path, what)
    return out

