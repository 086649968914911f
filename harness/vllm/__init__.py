"""Running vLLM for tests, demos and benchmarks: servers with the connector (``server``), the trio of
roles beside their sidecars (``pair``), one P and N MDs over a topology file (``pool``), a tiny model
built locally (``tiny_model``), extend timing."""

# vLLM's --logits-processors entry for pddlink's position-seeded sampling (seeded answers exact across
# a handoff); a name, so that naming it does not import vLLM.
SEEDED_SAMPLING = "engines_adapter.vllm.sampling:PositionSeededSampling"
