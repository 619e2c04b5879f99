"""The package versions a connector process runs, reported in ``Source.versions`` (issue 41
item 5: version skew).

Engines share pool values only when they agree on what a key means and how it is written: the
kvpool release (key grammar, chunk hashing), the store client (a Mooncake client of another
version than its master once served a silent 0% hit rate: Mooncake PR #2579) and the wire
protocol between agent and hub. The console compares them across the engines of one model
(``kvpool_console.alerts.versions``). Read once per process from the installed distributions'
metadata (``importlib.metadata``): nothing is imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

from kvpool_agent.protocol import PROTOCOL_VERSION

__all__ = ["PACKAGES", "package_versions"]

PACKAGES: dict[str, str] = {
    "kvpool": r"kvpool",
    "vllm": r"vllm(-cpu|-tpu|-rocm)?",
    "mooncake": r"mooncake-transfer-engine(-.*)?",
    "memcache": r"memcache[-_]hybrid",
    "yuanrong": r"openyuanrong-datasystem",
}
"""``Source.versions`` key -> the distribution names (regex, normalised to lower case and
``-``) that provide it: the Mooncake wheel is published per platform under several names."""


@functools.cache
def package_versions() -> dict[str, str]:
    """``{"protocol": PROTOCOL_VERSION, <PACKAGES key>: version}`` of the packages installed
    (a package not installed is left out). Cached: one scan of the installed distributions per
    process (tens of ms)."""
    out = {"protocol": str(PROTOCOL_VERSION)}
    patterns = {k: re.compile(p) for k, p in PACKAGES.items()}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", str(dist.metadata["Name"] or "")).lower()
        for key, pattern in patterns.items():
            if key not in out and pattern.fullmatch(name):
                out[key] = dist.version
    return dict(sorted(out.items()))
