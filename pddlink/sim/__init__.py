"""Workloads, the shared trace format and the discrete-event cluster simulator behind ``pddlink sim``.

- ``trace``: the JSONL trace shared with ``pddlink demo`` (``TraceRequest``, ``read_trace`` also
  loads Mooncake traces, ``write_trace``, ``scale_trace``, ``block_token_ids``);
- ``workload`` / ``generate``: the workload file and agentic sessions with real shared prefixes;
- ``hardware`` / ``deploy`` / ``resources`` / ``engine`` / ``cache``: time models per hardware type,
  deployments, the fluid resources (WAN line, P, decode), one simulated run with the real
  ``pddlink.drc`` index and ``pddlink.routing`` policy;
- ``records`` / ``scenario`` / ``demo_scale`` / ``plots``: figures, the calibrated scenario, skew and
  sweeps, the demo's scaled-down deployment, PNG plots.
"""
