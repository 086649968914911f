"""``pddlink chaos``: faults under a bounded streaming load, and the invariants that must hold.

``schedule`` (which faults, when), ``load`` (the streaming clients), ``invariants`` (what the
clients saw, checked; pure), ``report`` (table, PNG timeline), ``run`` (the deployment and the
run). At pool scale (``--topology F``): ``pools`` (a topology's pools, faults of one instance of
several) and ``pool_measures`` (whose requests a killed or drained instance had, how they ended;
pure).
"""
