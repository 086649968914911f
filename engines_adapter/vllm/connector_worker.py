"""``ConnectorWorker``: ``PddlinkConnector``'s worker half (``role=WORKER``, in each vLLM worker).
It moves the KV bytes between vLLM's paged cache and the sidecar's shared-memory region, doing
what the scheduler half put in the step's metadata (``PddlinkMetadata``).

P (kv_producer)
  ``bind_connector_metadata`` (before the step's forward): sends ALLOC for each of the step's saves
  without waiting (the answer, a region slot and the smallest reserved prefix when known, is read
  after the forward). ``wait_for_save`` (after the forward, which wrote the KV): copies the blocks
  from the slot's first one on out of vLLM's paged cache into it (``PagedKV.gather``), sends
  COMMIT (its answer is read, without waiting, at a later step once it arrived: a refused COMMIT
  releases the transfer then); the sidecar ships each destination its suffix from that one slot
  (RLD over the fast path, MD over the WAN).
MD and RelayDecode (kv_consumer)
  ``start_load_kv`` (before the forward when the step has a synchronous load): copies each
  synchronous load from its landing slot into the allocated blocks and RELEASEs it; a copy that
  cannot be made (the slot does not cover the blocks, a layout mismatch) reports those blocks in
  ``get_block_ids_with_load_errors`` in the same step, so vLLM fails the request or recomputes
  them (``kv_load_failure_policy``) and discards what that forward computed from them. It takes
  the step's asynchronous loads.
  ``get_transfer_results`` (every step, also while nothing is scheduled): POLLs the sidecar (the
  answer to one step's POLL is read, without waiting, at a later step; vLLM never waits on it); a
  landed transfer is copied from the landing slot into the allocated blocks, then RELEASEd, and
  reported finished; a failed one, or one past its deadline, is reported in ``failed_recving``
  (vLLM then fails the request with a reason or recomputes, per ``kv_load_failure_policy``) and
  never in a way that lets tokens come from KV that did not fully arrive.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from engines_adapter.vllm.connector_config import ConnectorConfig
from engines_adapter.vllm.connector_meta import LoadSpec, PddlinkMetadata, SaveSpec
from engines_adapter.vllm.hook_timing import HookClock
from engines_adapter.vllm.paged_kv import PagedKV
from engines_adapter.vllm.sidecar_channel import SidecarChannel
from pddlink.connector.control import Op, Pending, TransferState
from pddlink.connector.shm import MappedRegion, Slot
from pddlink.errors import PddlinkError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pddlink.vllm")


class ConnectorWorker:
    def __init__(self, config: ConnectorConfig, channel: SidecarChannel, clock: HookClock | None) -> None:
        self.producer = config.producer
        self.num_blocks = config.num_blocks
        self.layout = config.layout
        self.dump_dir = config.dump_dir
        self.dump_tag = config.dump_tag
        self.channel = channel
        self._clock = clock
        self._kv: PagedKV | None = None
        self._region: MappedRegion | None = None
        self._loads: dict[str, LoadSpec] = {}
        self._allocs: dict[str, tuple[Pending, float]] = {}  # transfer -> ALLOC sent, seconds it took
        self._commits: list[tuple[SaveSpec, Pending]] = []  # COMMITs whose answer is not read yet
        self._load_errors: set[int] = set()  # blocks a synchronous load could not fill (this step)
        self._poll: Pending | None = None  # the POLL for the asynchronous loads, not answered yet

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = PagedKV(kv_caches, self.num_blocks)

    def _mapped(self) -> MappedRegion:
        if self._region is None:
            status = self.channel.call(Op.STATUS)
            self._region = MappedRegion(Path(status["region"]))
        return self._region

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not self.producer or self._kv is None or not isinstance(connector_metadata, PddlinkMetadata):
            return
        self._check_commits()
        for save in connector_metadata.saves:  # ALLOC now; the answer is read after the forward
            t0 = time.perf_counter()
            pending = self.channel.send(
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
        self.channel.poll_answers()
        commits = [c for c in self._commits if c[1].done]
        self._commits = [c for c in self._commits if not c[1].done]
        for save, pending in commits:
            try:
                pending.result()
            except PddlinkError as exc:
                log.warning("request %s: the sidecar refused its KV: %s", save.req_id, exc)
                self.channel.call_or_warn(Op.RELEASE, transfer=save.transfer, reason=f"commit failed: {exc}")

    def start_load_kv(self, meta: PddlinkMetadata) -> None:
        for load in meta.loads:
            if load.landed is None:
                self._loads[load.req_id] = load  # asynchronous: polled in get_transfer_results
                continue
            ok = self._land(load, load.landed)  # synchronous: before this step's forward
            if not ok:
                self._load_errors.update(load.block_ids)
            self.channel.send_unawaited(
                Op.RELEASE, transfer=load.transfer, reason="loaded" if ok else "load failed"
            )
        if meta.loads and self._clock is not None:
            self._clock.mark("load")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_save(self, meta: PddlinkMetadata) -> None:
        for save in meta.saves:
            try:
                self._save(save)
            except PddlinkError as exc:
                log.warning("request %s: KV not handed to the sidecar: %s", save.req_id, exc)
                self.channel.call_or_warn(Op.RELEASE, transfer=save.transfer, reason=f"save failed: {exc}")

    def _save(self, save: SaveSpec) -> None:
        t0 = time.perf_counter()
        assert self._kv is not None
        n = len(save.block_ids)
        pending, sent_s = self._allocs.pop(save.transfer, (None, 0.0))
        if pending is None:  # not sent before the forward (no bind_connector_metadata): ask now
            pending = self.channel.send(
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
        commit = self.channel.send(
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
            self.channel.poll_answers()
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
            outcome = "loaded" if ok else "load failed"
            self.channel.send_unawaited(Op.RELEASE, transfer=transfer, reason=outcome)
            del self._loads[load.req_id]
        if self._loads and self._poll is None:
            self._poll = self.channel.send(Op.POLL, transfers=[x.transfer for x in self._loads.values()])
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
