"""``kvpool-config``: deployment-config checks for the KV pool (issue 5).

Rules are importable one by one from :mod:`kvpool_connector.validate.rules` (the console's
alerts use the same thresholds); :func:`validate_files` runs all of them on files.
"""

from kvpool_connector.validate.loader import ConfigLoadError, detect_shape, load_json
from kvpool_connector.validate.rules import Finding, check_lease_ttl
from kvpool_connector.validate.validator import (
    FileReport,
    Options,
    validate_document,
    validate_files,
)

__all__ = [
    "ConfigLoadError",
    "FileReport",
    "Finding",
    "Options",
    "check_lease_ttl",
    "detect_shape",
    "load_json",
    "validate_document",
    "validate_files",
]
