"""What the request-body fuzz tests share: how many cases they run and where they record the count.

``PDDLINK_FUZZ_CASES`` (default 100,000: the CI run) sets the in-process cases of each fuzz test;
``pddlink bench fuzz --cases N`` raises it for a benchmark run. With ``PDDLINK_FUZZ_JSON`` set, each
test adds its counts to that JSON object (``{"http": {...}, "grpc": {...}}``), which the bench
command reads; every test prints them too (``pytest -s``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CASES = int(os.environ.get("PDDLINK_FUZZ_CASES", "100000"))
TIMEOUT_S = 600 * max(1, -(-CASES // 100_000))  # CI's 100,000 take 15-30 s on 2 cores


def record(api: str, seen: dict[str, int], seconds: float) -> None:
    cases = sum(seen.values())
    figures: dict[str, Any] = {
        "cases": cases,
        **seen,
        "seconds": round(seconds, 3),
        "cases_per_s": round(cases / max(seconds, 1e-9), 1),
    }
    print(f"fuzz {api}: {figures}")
    path = os.environ.get("PDDLINK_FUZZ_JSON")
    if path:
        p = Path(path)
        out = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
        out[api] = figures
        p.write_text(json.dumps(out, indent=1) + "\n")
