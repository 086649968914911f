"""Build hooks: the sidecar's gRPC modules and the one optional C extension; all other metadata is
in pyproject.toml.

The gRPC modules of ``pddlink/serving/proto/*.proto`` and their type stubs are generated here, at build
time (``python -m pddlink.serving.rpc``, with grpcio-tools and mypy-protobuf from ``build-system.requires``),
into ``pddlink/serving/proto_gen/`` before the packages are collected, so wheels and images ship them and
nothing is generated when the package is imported.

``pddlink.kv._native_hash`` is the native loop of the block-hash chain (see pddlink/kv/hashing.py). It
needs a C compiler, Python's headers and libxxhash's (Debian/Ubuntu: ``libxxhash-dev``, which
scripts/setup.sh installs). It is optional: where any of these is missing the build warns and goes
on, and ``pddlink.kv.hashing`` uses its pure-Python path (same results, slower).
"""

import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
if (HERE / "pddlink" / "serving" / "proto").is_dir():
    subprocess.run([sys.executable, "-m", "pddlink.serving.rpc"], cwd=HERE, check=True)

setup(
    ext_modules=[
        Extension(
            "pddlink.kv._native_hash",
            sources=["pddlink/kv/_native_hash.c"],
            libraries=["xxhash"],
            optional=True,
        )
    ]
)
