"""The protocol between ``PddlinkConnector`` (inside a vLLM process, ``engines_adapter.vllm``) and the
sidecar beside it: the control socket's messages (``control``), the shared-memory slots KV moves
through (``shm``) and vLLM's KV-cache event feed (``kv_events``). Both sides import it; it imports
neither."""
