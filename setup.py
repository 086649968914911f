"""Build hook for the one optional C extension; all other metadata is in pyproject.toml.

``pddlink.kv._native_hash`` is the native loop of the block-hash chain (see pddlink/kv/hashing.py). It
needs a C compiler, Python's headers and libxxhash's (Debian/Ubuntu: ``libxxhash-dev``, which
scripts/setup.sh installs). It is optional: where any of these is missing the build warns and goes
on, and ``pddlink.kv.hashing`` uses its pure-Python path (same results, slower).
"""

from setuptools import Extension, setup

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
