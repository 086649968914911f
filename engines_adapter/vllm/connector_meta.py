"""What ``PddlinkConnector``'s scheduler side hands its worker side each step (``PddlinkMetadata``:
the saves and loads of that step), the request's ``kv_transfer_params`` as the connector reads
them (``TransferParams``), and the scheduler's per-request records (producer, consumer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.request import Request

PARAMS_KEY = "pddlink"


@dataclass(frozen=True, slots=True)
class TransferParams:
    transfer: str
    deadline_at: float  # wall clock (time.time()): shared by the processes of one host
    to: tuple[str, ...] | None = None  # P: the destinations (None: every configured one)
    kv_tokens: int | None = None  # consumer: the transfer covers this many prompt tokens
    # P: the instance each destination role ships to, by its topology name (("md", NAME), ...)
    instances: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, request: Request) -> TransferParams | None:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not isinstance(params, dict) or not isinstance(params.get("transfer"), str):
            return None
        deadline_s = float(params.get("deadline_s", 30.0))
        to = params.get("to")
        kv_tokens = params.get("kv_tokens")
        named = tuple((r, params[r]) for r in ("md", "rld") if isinstance(params.get(r), str))
        return cls(
            params["transfer"],
            request.arrival_time + deadline_s,
            tuple(str(t) for t in to) if isinstance(to, list) and to else None,
            kv_tokens if isinstance(kv_tokens, int) and not isinstance(kv_tokens, bool) else None,
            named,
        )


@dataclass(frozen=True, slots=True)
class SaveSpec:
    req_id: str
    transfer: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LoadSpec:
    req_id: str
    transfer: str
    first_block: int  # the request's block index that block_ids[0] is
    block_ids: tuple[int, ...]
    deadline_at: float
    landed: dict[str, Any] | None = None  # the landed state when planned: a synchronous load


@dataclass
class PddlinkMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class Producing:
    params: TransferParams
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    saved: bool = False


@dataclass
class Consuming:
    params: TransferParams
    first_block: int = 0
    computed: int = 0  # vLLM's own prefix hit when the load was planned (block aligned)
    load: LoadSpec | None = None
    landed: dict[str, Any] | None = None  # POLL's answer, when the KV had landed already
