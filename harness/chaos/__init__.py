"""``pddlink chaos``: faults under a bounded streaming load, and the invariants that must hold.

``schedule`` (which faults, when), ``load`` (the streaming clients), ``invariants`` (what the
clients saw, checked; pure), ``report`` (table, PNG timeline), ``run`` (the deployment and the run).
"""
