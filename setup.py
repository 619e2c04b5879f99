"""kvpool's one C extension; everything else about the build is in pyproject.toml.

``kvpool_connector._chunk_hash`` runs the hot loops of the scheduler's lookup keys (packing
token ids, the chained SHA-256 through OpenSSL, building key strings; see its source).
Building it needs a C compiler, the Python headers and OpenSSL's headers (Debian: gcc,
python3-dev, libssl-dev; ``scripts/setup.sh`` installs what is missing).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpool_connector._chunk_hash",
            sources=["kvpool_connector/_chunk_hash.c"],
            libraries=["crypto"],
            extra_compile_args=["-Wall", "-Wextra"],
        )
    ]
)
