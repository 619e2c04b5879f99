"""``kvpool-config``: check KV-pool deployment configs before anything starts.

:func:`validate_files` loads files, tells their shape (:func:`detect_shape`: MindIE
``user_config.json`` or ``env.json``, vLLM ``kv_transfer_config``, Mooncake ``mooncake.json``)
and runs that shape's checks; :func:`validate_document` does the same for a decoded document.
The rules themselves are importable one by one from :mod:`kvpool_config.rules`. They check files
only: the console's alerts are their own rules over what running agents report.
:func:`render_mooncake` writes the ``mooncake_master`` command and ``mooncake.json`` of a
user_config; :func:`schema_text` is the JSON Schema of the KV-pool part
(``config/kvpool.schema.json``). The command line is :mod:`kvpool_config.cli`.

Sizes (``global_segment_size`` ...) are read with :func:`kvpool_connector.sizes.parse_size`, the
parser the Mooncake backend itself uses.
"""

from kvpool_config._context import Options
from kvpool_config._files import FileReport, validate_files
from kvpool_config._loader import ConfigLoadError, load_json
from kvpool_config._registry import Shape, detect_shape, validate_document
from kvpool_config._render import Rendered, RenderError, render_mooncake
from kvpool_config._schema import kvpool_schema, schema_text
from kvpool_config.rules import Finding

__all__ = [
    "ConfigLoadError",
    "FileReport",
    "Finding",
    "Options",
    "RenderError",
    "Rendered",
    "Shape",
    "detect_shape",
    "kvpool_schema",
    "load_json",
    "render_mooncake",
    "schema_text",
    "validate_document",
    "validate_files",
]
