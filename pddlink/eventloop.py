"""Running a service's main coroutine on uvloop where it is installed, else on asyncio's loop.

Only the import of uvloop is guarded: an ``ImportError`` raised while the service runs propagates
like any other error (it must not silently restart the service under the other loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(main: Coroutine[Any, Any, T], *, prefer_uvloop: bool = True, warn_without: bool = False) -> T:
    """``uvloop.run(main)`` if ``prefer_uvloop`` and uvloop imports, else ``asyncio.run(main)``."""
    if prefer_uvloop:
        try:
            import uvloop
        except ImportError:
            if warn_without:
                log.warning("uvloop is not installed; using asyncio's event loop")
        else:
            return uvloop.run(main)
    return asyncio.run(main)
