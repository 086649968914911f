"""pddlink beside vLLM: the KV connector plugged into vLLM, and the helpers that set vLLM up.

vLLM is an optional dependency (``pip install 'pddlink[vllm]'``, done by ``scripts/setup.sh``);
nothing here imports it at module level, so the package imports where vLLM is not installed.
"""
