"""Running vLLM for tests, demos and benchmarks: servers with the connector (``server``), the trio of
roles beside their sidecars (``pair``), a tiny model built locally (``tiny_model``), extend timing."""
