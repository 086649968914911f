"""The two processes of ``pddlink bench link`` (``peer``) and the coordinator that runs them (``run``)."""
