"""``PddlinkConnector``: vLLM's KV connector that hands KV to and from the local pddlink sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "PddlinkConnector",
      "kv_connector_module_path": "engines_adapter.vllm.connector",
      "kv_role": "kv_producer" | "kv_consumer",
      "kv_connector_extra_config": {"control_socket": "/run/pddlink/p.sock"}}'

A request takes part when its ``kv_transfer_params`` hold ``{"pddlink": {"transfer": ID,
"deadline_s": S}}`` (the router sets them); others run as if no connector were loaded. Optional:
``"to": ["rld", "md"]`` on P (the destinations to ship to; default: every one P's sidecar links),
``"md": NAME`` / ``"rld": NAME`` on P (which instance of that role, by its name in the topology
P's sidecar reads: pools; default: the one P's sidecar links),
``"kv_tokens": N`` on a consumer (the transfer carries the KV of the first N tokens of this request's
prompt, i.e. P's prompt; the default is the whole prompt). With ``kv_tokens`` the token-id handoff is
one request: MD gets P's prompt + the k tokens RelayDecode generated, loads the whole blocks below
token N from the transfer, and vLLM computes the prompt's tail and the k tokens in one step (the
extend), then decodes on.

vLLM builds the connector twice: scheduler side (in the engine core process, ``role=SCHEDULER``)
and worker side (in each worker, ``role=WORKER``); in-process mode both live in one process.
``PddlinkConnector`` is what vLLM loads (by this module path and class name): it reads the config
once (``ConnectorConfig``), opens its side's control channel to the sidecar (``SidecarChannel``),
builds the half its role needs and hands each hook vLLM calls to that half:

  ``ConnectorScheduler`` (``connector_scheduler``): ``get_num_new_matched_tokens``,
      ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``: which requests
      take part, what each step saves (P) or loads (a consumer), PREPARE / POLL (EXPECT) / RELEASE.
  ``ConnectorWorker`` (``connector_worker``): ``register_kv_caches``, ``bind_connector_metadata``,
      ``start_load_kv``, ``get_block_ids_with_load_errors``, ``wait_for_save``,
      ``get_transfer_results`` / ``get_finished``: the KV bytes between vLLM's paged cache and the
      sidecar's region, ALLOC / COMMIT / POLL / RELEASE.

The hand-over between them is the step's ``PddlinkMetadata`` (``connector_meta``). Which hook runs
when, on each side, for P (kv_producer) and for MD and RelayDecode (kv_consumer), is in each half's
module docstring: on P the scheduler plans a save in the step whose prefill completes and the
worker copies it into a region slot after that step's forward; on a consumer the scheduler learns
where the transfer starts and plans a load, and the worker copies the landed KV into vLLM's blocks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from engines_adapter.vllm.connector_config import ConnectorConfig, require_in_process_engine
from engines_adapter.vllm.connector_meta import PddlinkMetadata
from engines_adapter.vllm.connector_scheduler import ConnectorScheduler
from engines_adapter.vllm.connector_worker import ConnectorWorker
from engines_adapter.vllm.cpu_attention import attention_without_amx
from engines_adapter.vllm.hook_timing import HookClock
from engines_adapter.vllm.sidecar_channel import SidecarChannel

attention_without_amx()

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PddlinkConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        require_in_process_engine(os.environ)
        self.config = ConnectorConfig.of(self._kv_transfer_config, vllm_config, kv_cache_config)
        self.channel = SidecarChannel(self.config.control_socket)
        worker = role == KVConnectorRole.WORKER
        # the clock wraps this instance's hooks (the ones vLLM calls); the worker half marks and
        # notes on it what a step carried
        self._clock = HookClock.install(self, self.config.timing_file, worker=worker)
        self._scheduler = None if worker else ConnectorScheduler(self.config, self.channel)
        self._worker = ConnectorWorker(self.config, self.channel, self._clock) if worker else None

    @property
    def scheduler(self) -> ConnectorScheduler:
        """The scheduler half; only the ``role=SCHEDULER`` instance has one."""
        assert self._scheduler is not None, "a scheduler hook called on PddlinkConnector's worker side"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        """The worker half; only the ``role=WORKER`` instance has one."""
        assert self._worker is not None, "a worker hook called on PddlinkConnector's scheduler side"
        return self._worker

    def _step_metadata(self) -> PddlinkMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddlinkMetadata)
        return meta

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._step_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the whole request is copied once in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._step_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def shutdown(self) -> None:
        self.channel.close()
