"""The sidecar's half of the vLLM KV path: the shared-memory region vLLM's connector writes KV into
(P) or reads it from (MD), the control channel between connector and sidecar, and the bridges that
move region slots over the WAN transports. The connector half is ``engines_adapter.vllm.connector``.
"""
