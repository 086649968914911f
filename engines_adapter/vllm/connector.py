"""``PddlinkConnector``: vLLM's KV connector that hands KV to and from the local pddlink sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "PddlinkConnector",
      "kv_connector_module_path": "engines_adapter.vllm.connector",
      "kv_role": "kv_producer" | "kv_consumer",
      "kv_connector_extra_config": {"control_socket": "/run/pddlink/p.sock"}}'

A request takes part when its ``kv_transfer_params`` hold ``{"pddlink": {"transfer": ID,
"deadline_s": S}}`` (the router sets them); others run as if no connector were loaded. Optional:
``"to": ["rld", "md"]`` on P (the destinations to ship to; default: every one P's sidecar links),
``"kv_tokens": N`` on a consumer (the transfer carries the KV of the first N tokens of this request's
prompt, i.e. P's prompt; the default is the whole prompt). With ``kv_tokens`` the token-id handoff is
one request: MD gets P's prompt + the k tokens RelayDecode generated, loads the whole blocks below
token N from the transfer, and vLLM computes the prompt's tail and the k tokens in one step (the
extend), then decodes on.

vLLM builds the connector twice: scheduler side (in the engine core process, ``role=SCHEDULER``)
and worker side (in each worker, ``role=WORKER``); in-process mode both live in one process.
Which hook runs when, on each side:

P (kv_producer)
  scheduler  ``get_num_new_matched_tokens`` (first sight of the request): PREPARE to the sidecar
             (with ``to`` when given; sent without waiting for its answer, as every RELEASE is:
             the answer is read, and a refusal logged, when the channel is next used), which
             reserves each destination's cached prefix while vLLM prefills (RLD's answer is 0: it
             gets every whole block); answers 0 (nothing to load).
             ``build_connector_meta`` (each step): follows the request's blocks; in the step where
             its prefill completes it adds a save of its whole blocks below the last prompt token
             (MD recomputes that tail of < 1 block itself) to the step's metadata.
             ``request_finished``: forgets it; a request that ended before its save releases the
             transfer at the sidecar. Blocks are freed at once (the save was synchronous).
  worker     ``bind_connector_metadata`` (before the step's forward): sends ALLOC for each of the
             step's saves without waiting (the answer, a region slot and the smallest reserved prefix
             when known, is read after the forward). ``wait_for_save`` (after the forward, which
             wrote the KV): copies the blocks from the slot's first one on out of vLLM's paged
             cache into it (``PagedKV.gather``), sends COMMIT (its answer is read, without
             waiting, at a later step once it arrived: a refused COMMIT releases the transfer
             then); the sidecar ships each destination its suffix from that one slot (RLD over
             the fast path, MD over the WAN).
MD and RelayDecode (kv_consumer; RLD is fed over the fast path, MD across the WAN)
  scheduler  ``get_num_new_matched_tokens``: asks the sidecar (EXPECT) where the transfer starts
             (the prefix MD reserved for it), without waiting: the POLL sent at one ask is read at
             the next, when answered; ``None`` (ask again) until known; then
             ``(tail start - computed, True)``, tail start being the last whole block below
             ``kv_tokens`` (or the prompt's last token): an asynchronous load, vLLM parks the
             request (on MD handed prompt + k, the tail and the k tokens are then one step).
             When the same answer says the transfer has already landed (all of it: a transfer
             is landed only once its last byte is in the slot), ``(tail start - computed,
             False)``: a synchronous load, copied by the worker before this very step's forward,
             so the request is neither parked nor polled for (one engine step and a POLL round
             trip fewer; the usual case when the router sends MD the request after P answered).
             When
             vLLM's own prefix cache no longer holds the reserved prefix (evicted meanwhile), or
             the transfer failed or missed its deadline before it was known: 0, and vLLM
             recomputes the prompt itself (correct tokens, counted by reason).
             ``update_state_after_alloc``: records the blocks vLLM allocated for the load;
             ``build_connector_meta`` passes them to the worker. ``request_finished`` (also on
             abort and client disconnect): RELEASE at the sidecar (frees a landed slot).
  worker     ``start_load_kv`` (before the forward when the step has a synchronous load): copies
             each synchronous load from its landing slot into the allocated blocks and RELEASEs it;
             a copy that cannot be made (the slot does not cover the blocks, a layout mismatch)
             reports those blocks in ``get_block_ids_with_load_errors`` in the same step, so vLLM
             fails the request or recomputes them (``kv_load_failure_policy``) and discards what
             that forward computed from them. It takes the step's asynchronous loads.
             ``get_transfer_results`` (every step,
             also while nothing is scheduled): POLLs the sidecar (the answer to one step's POLL is
             read, without waiting, at a later step; vLLM never waits on it); a landed transfer is copied from
             the landing slot into the allocated blocks, then RELEASEd, and reported finished; a
             failed one, or one past its deadline, is reported in ``failed_recving`` (vLLM then
             fails the request with a reason or recomputes, per ``kv_load_failure_policy``) and
             never in a way that lets tokens come from KV that did not fully arrive.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from engines_adapter.vllm.connector_meta import (
    Consuming,
    LoadSpec,
    PddlinkMetadata,
    Producing,
    SaveSpec,
    TransferParams,
)
from engines_adapter.vllm.cpu_attention import attention_without_amx
from engines_adapter.vllm.hook_timing import HookClock
from engines_adapter.vllm.paged_kv import PagedKV
from pddlink.errors import PddlinkError
from sidecar.vllm_kv.control import ControlClient, Op, Pending, TransferState
from sidecar.vllm_kv.shm import MappedRegion, Slot

attention_without_amx()

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pddlink.vllm")


class PddlinkConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.producer = cfg.is_kv_producer
        sock = cfg.get_from_extra_config("control_socket", None)
        if not sock:
            raise ValueError("PddlinkConnector needs kv_connector_extra_config.control_socket")
        self.control = ControlClient(Path(sock))
        dump = cfg.get_from_extra_config("kv_dump_dir", None)  # tests: the KV bytes each side held
        self.dump_dir = Path(dump) if dump else None
        # the dump files' prefix: "P" / "MD" by role; RelayDecode's launcher sets "RLD"
        self.dump_tag = str(cfg.get_from_extra_config("dump_tag", "P" if self.producer else "MD"))
        timing = cfg.get_from_extra_config("timing_file", None)  # bench: hook timings, JSON lines
        self.timing_file = Path(timing) if timing else None
        # answers nobody waits for (PREPARE, RELEASE): read when the channel is next used, logged
        # if refused; the sidecar handles requests in order, so a later ALLOC/POLL sees their effect
        self._unread: list[tuple[str, Pending]] = []
        self.num_blocks = kv_cache_config.num_blocks
        mc, par = vllm_config.model_config, vllm_config.parallel_config
        self.layout = {
            "num_layers": mc.get_num_layers(par),
            "num_kv_heads": mc.get_num_kv_heads(par),
            "head_dim": mc.get_head_size(),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "block_size": self.block_size,
        }
        # scheduler side
        self._producing: dict[str, Producing] = {}
        self._consuming: dict[str, Consuming] = {}
        self._new_saves: list[SaveSpec] = []
        self._new_loads: list[LoadSpec] = []
        self.recomputed: dict[str, int] = {}  # reason -> requests MD prefilled itself
        self._local_hit: dict[str, int] = {}
        self._asks: dict[str, Pending] = {}  # consumer: request -> its POLL not answered yet
        # worker side
        self._kv: PagedKV | None = None
        self._region: MappedRegion | None = None
        self._loads: dict[str, LoadSpec] = {}
        self._allocs: dict[str, tuple[Pending, float]] = {}  # transfer -> ALLOC sent, seconds it took
        self._commits: list[tuple[SaveSpec, Pending]] = []  # COMMITs whose answer is not read yet
        self._load_errors: set[int] = set()  # blocks a synchronous load could not fill (this step)
        self._poll: Pending | None = None  # the POLL for the asynchronous loads, not answered yet
        self._clock = HookClock.install(self, self.timing_file, worker=role == KVConnectorRole.WORKER)

    # ---------------------------------------------------------------- scheduler side

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
                extra = {} if params.to is None else {"to": list(params.to)}
                self._send(
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
            self.control.poll_answers()
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
        self._asks[rid] = self.control.send(Op.POLL, transfers=[transfer], expect=True)
        return {}

    def _recompute(self, rid: str, params: TransferParams, reason: str) -> tuple[int, bool]:
        key = reason.split(":")[0]
        self.recomputed[key] = self.recomputed.get(key, 0) + 1
        log.warning("request %s: prefilled on MD itself (%s)", rid, reason)
        self._asks.pop(rid, None)
        self._send(Op.RELEASE, transfer=params.transfer, reason=reason)
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PddlinkMetadata(saves=self._new_saves, loads=self._new_loads)
        self._new_saves, self._new_loads = [], []
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
            self._send(Op.RELEASE, transfer=p.params.transfer, reason="request ended before its KV was saved")
        c = self._consuming.pop(rid, None)
        local = self._local_hit.pop(rid, None)
        self._asks.pop(rid, None)
        if not self.producer and (params := TransferParams.of(request)) is not None:
            self._send(
                Op.RELEASE,
                transfer=params.transfer,
                reason="request finished",
                local_tokens=local,
                prompt_tokens=len(request.prompt_token_ids or []),
                loaded=c is not None and c.load is not None,
            )
        return False, None

    def _call(self, op: Op, **fields: Any) -> dict[str, Any] | None:
        try:
            return self.control.call(op, **fields)
        except PddlinkError as exc:
            log.warning("pddlink sidecar %s failed: %s", op.value, exc)
            return None
        finally:
            self._log_unread()

    def _send(self, op: Op, **fields: Any) -> None:
        """A request whose answer vLLM need not wait for: written now, its answer read (and a
        refusal logged) the next time this side uses the channel."""
        self._log_unread()
        self._unread.append((str(fields.get("transfer", "")), self.control.send(op, **fields)))

    def _log_unread(self) -> None:
        if not self._unread:
            return
        self.control.poll_answers()
        keep = []
        for transfer, pending in self._unread:
            if not pending.done:
                keep.append((transfer, pending))
                continue
            try:
                pending.result()
            except PddlinkError as exc:
                log.warning("pddlink sidecar %s of %s failed: %s", pending.op.value, transfer, exc)
        self._unread = keep

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = PagedKV(kv_caches, self.num_blocks)

    def _mapped(self) -> MappedRegion:
        if self._region is None:
            status = self.control.call(Op.STATUS)
            self._region = MappedRegion(Path(status["region"]))
        return self._region

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not self.producer or self._kv is None or not isinstance(connector_metadata, PddlinkMetadata):
            return
        self._check_commits()
        for save in connector_metadata.saves:  # ALLOC now; the answer is read after the forward
            t0 = time.perf_counter()
            pending = self.control.send(
                Op.ALLOC,
                transfer=save.transfer,
                num_blocks=len(save.block_ids),
                bytes_per_block=self._kv.bytes_per_block,
            )
            self._allocs[save.transfer] = (pending, time.perf_counter() - t0)

    def _check_commits(self) -> None:
        """COMMIT answers that have arrived (read without waiting); a refusal releases the transfer."""
        if not self._commits:
            return
        self.control.poll_answers()
        commits = [c for c in self._commits if c[1].done]
        self._commits = [c for c in self._commits if not c[1].done]
        for save, pending in commits:
            try:
                pending.result()
            except PddlinkError as exc:
                log.warning("request %s: the sidecar refused its KV: %s", save.req_id, exc)
                self._call(Op.RELEASE, transfer=save.transfer, reason=f"commit failed: {exc}")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddlinkMetadata)
        for load in meta.loads:
            if load.landed is None:
                self._loads[load.req_id] = load  # asynchronous: polled in get_transfer_results
                continue
            ok = self._land(load, load.landed)  # synchronous: before this step's forward
            if not ok:
                self._load_errors.update(load.block_ids)
            self._send(Op.RELEASE, transfer=load.transfer, reason="loaded" if ok else "load failed")
        if meta.loads and self._clock is not None:
            self._clock.mark("load")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the whole request is copied once in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddlinkMetadata)
        for save in meta.saves:
            try:
                self._save(save)
            except PddlinkError as exc:
                log.warning("request %s: KV not handed to the sidecar: %s", save.req_id, exc)
                self._call(Op.RELEASE, transfer=save.transfer, reason=f"save failed: {exc}")

    def _save(self, save: SaveSpec) -> None:
        t0 = time.perf_counter()
        assert self._kv is not None
        n = len(save.block_ids)
        pending, sent_s = self._allocs.pop(save.transfer, (None, 0.0))
        if pending is None:  # not sent before the forward (no bind_connector_metadata): ask now
            pending = self.control.send(
                Op.ALLOC, transfer=save.transfer, num_blocks=n, bytes_per_block=self._kv.bytes_per_block
            )
        answer = pending.result()
        first = min(int(answer["first_block"]), n)
        slot = Slot(int(answer["offset"]), int(answer["nbytes"]))
        t_alloc = time.perf_counter()
        buf = self._mapped().buffer(slot) if slot.nbytes else memoryview(b"")
        self._kv.gather(save.block_ids[first:], buf)
        t_copy = time.perf_counter()
        if self.dump_dir is not None and slot.nbytes:
            (self.dump_dir / f"{self.dump_tag}-{save.transfer}-{first}.bin").write_bytes(buf)
        commit = self.control.send(
            Op.COMMIT,
            transfer=save.transfer,
            offset=slot.offset,
            nbytes=slot.nbytes,
            first_block=first,
            num_blocks=n,
            num_tokens=save.num_tokens,
            layout=self.layout,
        )
        self._commits.append((save, commit))
        if self._clock is not None:
            clock = self._clock
            clock.mark("save")
            for name, value in (
                ("alloc_send_s", sent_s), ("alloc_s", t_alloc - t0), ("copy_s", t_copy - t_alloc),
                ("commit_s", time.perf_counter() - t_copy), ("bytes", slot.nbytes), ("path", self._kv.path),
            ):  # fmt: skip
                clock.note(name, value)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if not self._loads:
            return results
        # the POLL sent at the previous step, when answered (read without waiting): vLLM's step
        # never waits on the sidecar; a landing is seen one step after the answer says so
        states: dict[str, Any] = {}
        if self._poll is not None:
            self.control.poll_answers()
            if self._poll.done:
                try:
                    states = self._poll.result().get("states", {})
                except PddlinkError as exc:
                    log.warning("pddlink sidecar poll failed: %s", exc)
                self._poll = None
        by_transfer = {load.transfer: load for load in self._loads.values()}
        now = time.time()
        for transfer, load in by_transfer.items():
            state = states.get(transfer, {})
            kind = state.get("state")
            if kind == TransferState.LANDED:
                ok = self._land(load, state)
            elif kind == TransferState.FAILED or now >= load.deadline_at:
                reason = state.get("reason") or "deadline_exceeded: KV did not arrive in time"
                log.warning("request %s: KV load failed: %s", load.req_id, reason)
                ok = False
            else:
                continue
            if not ok:
                results.failed_recving.add(load.req_id)
            results.finished_recving.add(load.req_id)
            self._send(Op.RELEASE, transfer=transfer, reason="loaded" if ok else "load failed")
            del self._loads[load.req_id]
        if self._loads and self._poll is None:
            self._poll = self.control.send(Op.POLL, transfers=[x.transfer for x in self._loads.values()])
        return results

    def _land(self, load: LoadSpec, state: dict[str, Any]) -> bool:
        """Copy the landed blocks the load needs into vLLM's blocks; False (never a partial load)
        when the transfer does not cover them all."""
        try:
            return self._copy_in(load, state)
        except (PddlinkError, KeyError, TypeError, ValueError) as exc:
            log.warning("request %s: KV load failed: %r", load.req_id, exc)
            return False

    def _copy_in(self, load: LoadSpec, state: dict[str, Any]) -> bool:
        assert self._kv is not None
        per_block = self._kv.bytes_per_block
        carried_first, carried = int(state["first_block"]), int(state["num_blocks"])
        skip = load.first_block - carried_first
        need = len(load.block_ids)
        if skip < 0 or skip + need > carried or int(state["bytes_per_block"]) != per_block:
            log.warning(
                "request %s: the transfer carries blocks %d..%d, the load needs %d..%d",
                load.req_id,
                carried_first,
                carried_first + carried,
                load.first_block,
                load.first_block + need,
            )
            return False
        t0 = time.perf_counter()
        slot = Slot(int(state["offset"]) + skip * per_block, need * per_block)
        self._kv.scatter(load.block_ids, self._mapped().buffer(slot))
        if self._clock is not None:
            self._clock.mark("load")
            self._clock.note("copy_s", time.perf_counter() - t0)
            self._clock.note("bytes", slot.nbytes)
        if self.dump_dir is not None:  # read back what vLLM's blocks now hold
            out = bytearray(need * per_block)
            self._kv.gather(load.block_ids, memoryview(out))
            (self.dump_dir / f"{self.dump_tag}-{load.transfer}-{load.first_block}.bin").write_bytes(out)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        self.control.close()
