"""``ConnectorScheduler``: ``PddlinkConnector``'s scheduler half (``role=SCHEDULER``, in vLLM's
engine core process). It decides, per request, what the step's worker saves (P) or loads (a
consumer), and tells the sidecar what each request is doing; it never waits on the sidecar.

P (kv_producer)
  ``get_num_new_matched_tokens`` (first sight of the request): PREPARE to the sidecar (with ``to``,
  ``md`` and ``rld`` when given; sent without waiting for its answer, as every RELEASE is: the
  answer is read, and a refusal logged, when the channel is next used), which reserves each
  destination's cached prefix while vLLM prefills (RLD's answer is 0: it gets every whole block);
  answers 0 (nothing to load).
  ``build_connector_meta`` (each step): follows the request's blocks; in the step where its prefill
  completes it adds a save of its whole blocks below the last prompt token (MD recomputes that tail
  of < 1 block itself) to the step's metadata.
  ``request_finished``: forgets it; a request that ended before its save releases the transfer at
  the sidecar. Blocks are freed at once (the save was synchronous).
MD and RelayDecode (kv_consumer; RLD is fed over the fast path, MD across the WAN)
  ``get_num_new_matched_tokens``: asks the sidecar (EXPECT) where the transfer starts (the prefix
  MD reserved for it), without waiting: the POLL sent at one ask is read at the next, when
  answered; ``None`` (ask again) until known; then ``(tail start - computed, True)``, tail start
  being the last whole block below ``kv_tokens`` (or the prompt's last token): an asynchronous
  load, vLLM parks the request (on MD handed prompt + k, the tail and the k tokens are then one
  step). When the same answer says the transfer has already landed (all of it: a transfer is
  landed only once its last byte is in the slot), ``(tail start - computed, False)``: a
  synchronous load, copied by the worker before this very step's forward, so the request is
  neither parked nor polled for (one engine step and a POLL round trip fewer; the usual case when
  the router sends MD the request after P answered). When vLLM's own prefix cache no longer holds
  the reserved prefix (evicted meanwhile), or the transfer failed or missed its deadline before it
  was known: 0, and vLLM recomputes the prompt itself (correct tokens, counted by reason).
  ``update_state_after_alloc``: records the blocks vLLM allocated for the load;
  ``build_connector_meta`` passes them to the worker. ``request_finished`` (also on abort and
  client disconnect): RELEASE at the sidecar (frees a landed slot).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from engines_adapter.vllm.connector_config import ConnectorConfig
from engines_adapter.vllm.connector_meta import (
    Consuming,
    LoadSpec,
    PddlinkMetadata,
    Producing,
    SaveSpec,
    TransferParams,
)
from engines_adapter.vllm.sidecar_channel import SidecarChannel
from pddlink.connector.control import Op, Pending, TransferState
from pddlink.errors import PddlinkError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("pddlink.vllm")


class ConnectorScheduler:
    def __init__(self, config: ConnectorConfig, channel: SidecarChannel) -> None:
        self.block_size = config.block_size
        self.producer = config.producer
        self.channel = channel
        self._producing: dict[str, Producing] = {}
        self._consuming: dict[str, Consuming] = {}
        self._new_loads: list[LoadSpec] = []
        self.recomputed: dict[str, int] = {}  # reason -> requests MD prefilled itself
        self._local_hit: dict[str, int] = {}
        self._asks: dict[str, Pending] = {}  # consumer: request -> its POLL not answered yet

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = TransferParams.of(request)
        if params is None:
            return 0, False
        rid = request.request_id
        prompt = list(request.prompt_token_ids or [])
        if self.producer:
            if rid not in self._producing:
                self._producing[rid] = Producing(params, len(prompt))
                extra: dict[str, Any] = {} if params.to is None else {"to": list(params.to)}
                extra.update(params.instances)  # "md": NAME, "rld": NAME (pools)
                self.channel.send_unawaited(
                    Op.PREPARE,
                    transfer=params.transfer,
                    prompt=prompt,
                    deadline_at=params.deadline_at,
                    **extra,
                )
            return 0, False
        return self._consumer_match(request, params, len(prompt), num_computed_tokens)

    def _consumer_match(
        self, request: Request, params: TransferParams, prompt_len: int, computed: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._local_hit.setdefault(rid, computed)  # what vLLM held itself, reported at the end
        if rid in self._consuming and self._consuming[rid].load is not None:
            return 0, False  # already loaded once (a preempted request recomputes)
        state = self._asked(rid, params.transfer)
        first = state.get("first_block")
        if state.get("state") == TransferState.FAILED:
            return self._recompute(rid, params, f"transfer failed: {state.get('reason')}")
        if not isinstance(first, int):
            if time.time() >= params.deadline_at:
                return self._recompute(rid, params, "deadline_exceeded: the transfer was not known in time")
            return None, False  # not known yet: vLLM asks again next step
        if computed < first * self.block_size:
            return self._recompute(rid, params, "reserved_prefix_evicted")
        carried = prompt_len if params.kv_tokens is None else params.kv_tokens
        if not 0 < carried <= prompt_len:
            return self._recompute(
                rid, params, f"bad_request: kv_tokens {carried} of a {prompt_len}-token prompt"
            )
        todo = (carried - 1) // self.block_size * self.block_size - computed  # see _maybe_save
        if todo <= 0:
            return self._recompute(rid, params, "nothing_to_load")
        landed = state if state.get("state") == TransferState.LANDED else None
        self._consuming[rid] = Consuming(params, first, computed, landed=landed)
        return todo, landed is None

    def _asked(self, rid: str, transfer: str) -> dict[str, Any]:
        """The transfer's state from the POLL sent at the previous ask, when it has been answered
        (read without waiting) and says where the transfer starts; else ``{}`` (unknown yet),
        with a POLL in flight for the next ask. The scheduler never waits on the sidecar: vLLM
        asks again next step, the request waiting meanwhile (it waits for its KV anyway)."""
        pending = self._asks.pop(rid, None)
        if pending is not None:
            self.channel.poll_answers()
            if not pending.done:
                self._asks[rid] = pending
                return {}
            try:
                state: dict[str, Any] = pending.result().get("states", {}).get(transfer, {})
            except PddlinkError as exc:
                log.warning("pddlink sidecar poll of %s failed: %s", transfer, exc)
                state = {}
            if state.get("state") == TransferState.FAILED or isinstance(state.get("first_block"), int):
                return state
        self._asks[rid] = self.channel.send(Op.POLL, transfers=[transfer], expect=True)
        return {}

    def _recompute(self, rid: str, params: TransferParams, reason: str) -> tuple[int, bool]:
        key = reason.split(":")[0]
        self.recomputed[key] = self.recomputed.get(key, 0) + 1
        log.warning("request %s: prefilled on MD itself (%s)", rid, reason)
        self._asks.pop(rid, None)
        self.channel.send_unawaited(Op.RELEASE, transfer=params.transfer, reason=reason)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        c = self._consuming.get(request.request_id)
        if self.producer or c is None or num_external_tokens <= 0 or c.load is not None:
            return
        ids = blocks.get_block_ids()[0]
        # request.num_computed_tokens is set only after this hook: use the hit recorded before
        start = c.computed // self.block_size
        end = -(-(c.computed + num_external_tokens) // self.block_size)
        c.load = LoadSpec(
            request.request_id,
            c.params.transfer,
            start,
            tuple(ids[start:end]),
            c.params.deadline_at,
            c.landed,
        )
        self._new_loads.append(c.load)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PddlinkMetadata:
        meta = PddlinkMetadata(saves=[], loads=self._new_loads)  # saves: added below (_maybe_save)
        self._new_loads = []
        if not self.producer:
            return meta
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            p = self._producing.get(new.req_id)
            if p is not None:
                p.blocks = list(new.block_ids[0])
                self._maybe_save(new.req_id, p, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            p = self._producing.get(rid)
            if p is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                p.blocks = list(new_ids[0]) if rid in cached.resumed_req_ids else p.blocks + list(new_ids[0])
            self._maybe_save(rid, p, cached.num_computed_tokens[i] + sched.get(rid, 0), meta)
        return meta

    def _maybe_save(self, rid: str, p: Producing, computed_after: int, meta: PddlinkMetadata) -> None:
        if p.saved or computed_after < p.prompt_len:
            return
        p.saved = True
        # whole blocks below the one holding the last prompt token: MD recomputes that tail itself
        # (< 1 block), so its vLLM resumes from a block boundary as after a local prefix hit
        nblocks = (p.prompt_len - 1) // self.block_size
        meta.saves.append(SaveSpec(rid, p.params.transfer, tuple(p.blocks[:nblocks]), p.prompt_len))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        p = self._producing.pop(rid, None)
        if p is not None and not p.saved:
            self.channel.send_unawaited(
                Op.RELEASE, transfer=p.params.transfer, reason="request ended before its KV was saved"
            )
        c = self._consuming.pop(rid, None)
        local = self._local_hit.pop(rid, None)
        self._asks.pop(rid, None)
        if not self.producer and (params := TransferParams.of(request)) is not None:
            self.channel.send_unawaited(
                Op.RELEASE,
                transfer=params.transfer,
                reason="request finished",
                local_tokens=local,
                prompt_tokens=len(request.prompt_token_ids or []),
                loaded=c is not None and c.load is not None,
            )
        return False, None
