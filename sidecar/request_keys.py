"""What a sidecar keys a request by, and what it refuses so that one request's tokens or KV never
reach another.

The key is the ``request_id`` of the sidecar RPCs, the KV transfer's ``request_id`` and, on vLLM,
the ``transfer`` of ``kv_transfer_params``. The router mints it per request and leg
(``router.mint_request_key``: ``<router name>-<128 random bits, hex>``), so two routers in front of the
same sidecars never share one. A sidecar does not rely on that (an old router keys by its client's
id): a second Attach, Prefill or PREPARE for a key it holds, or held lately, is refused with
``RequestKeyInUse`` (``ErrorCode.BAD_REQUEST``; gRPC ``ALREADY_EXISTS``) and changes nothing of the
request that holds it; KV that does not carry the held prompt's blocks is never imported
(``kv_mismatch``), nor is a second KV for one key, nor a handoff slice drawn with other sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines_adapter import SamplingParams
from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher
from pddlink.wire import TransferBegin


class RequestKeyInUse(InvalidInput):
    """A request key this sidecar already holds (or held lately): refused, nothing changed."""


def kv_mismatch(begin: TransferBegin, prompt: Sequence[int], hasher: BlockHasher) -> str:
    """Why the KV that ``begin`` opens is not ``prompt``'s ("" when it is): its token count and
    the hashes of its whole blocks must be the prompt's from ``first_block`` on."""
    carried = begin.first_block * hasher.block_size + begin.num_tokens
    if carried != len(prompt):
        return f"kv_mismatch: the KV holds {carried} tokens, the prompt {len(prompt)}"
    if tuple(begin.block_hashes) != tuple(hasher.hash_blocks(list(prompt))[begin.first_block :]):
        return "kv_mismatch: the KV's blocks are not the prompt's"
    return ""


def sampling_mismatch(given: SamplingParams, held: SamplingParams | None) -> str:
    """Why a handoff slice drawn with ``given`` is not the held request's ("" when it is): the
    fields the handoff carries must be equal."""
    if held is None:
        return ""
    fields = ("seed", "temperature", "top_k", "top_p", "max_tokens", "stop_token_ids")
    differ = [f for f in fields if getattr(given, f) != getattr(held, f)]
    return f"handoff_mismatch: the slice's sampling differs ({', '.join(differ)})" if differ else ""
