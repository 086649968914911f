"""Reference generations for the demo's exactness check: one engine, alone, in its own process.

``python -m harness.demo_reference REQUESTS.json OUT.json`` reads ``{"engine": {...}, "requests":
[{"prompt": [...], "sampling": {...}}]}`` and writes ``{"tokens": [[...], ...]}``: each request
prefilled and decoded to the end on one reference engine (float64, so batch composition cannot
change a token; requests are decoded in batches of 64 to save time).
"""

from __future__ import annotations

import json
import sys

from engines_adapter import SamplingParams, load_engine

BATCH = 64


def generate(spec: dict, requests: list[dict]) -> list[list[int]]:  # type: ignore[type-arg]
    import torch

    torch.set_num_threads(1)
    engine = load_engine("torch_ref", **spec)
    results: list[list[int]] = [[] for _ in requests]
    for start in range(0, len(requests), BATCH):
        live: dict[str, int] = {}
        for i in range(start, min(start + BATCH, len(requests))):
            rid = f"ref{i}"
            out = engine.prefill(
                rid, requests[i]["prompt"], SamplingParams.from_dict(requests[i]["sampling"])
            )
            results[i].append(out.token_id)
            if out.finished:
                engine.release(rid)
            else:
                live[rid] = i
        while live:
            for out in engine.decode(list(live)):
                i = live[out.request_id]
                results[i].append(out.token_id)
                if out.finished:
                    engine.release(out.request_id)
                    del live[out.request_id]
    return results


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    tokens = generate(job["engine"], job["requests"])
    with open(sys.argv[2], "w") as f:
        json.dump({"tokens": tokens}, f)


if __name__ == "__main__":
    main()
