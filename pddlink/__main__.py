"""``python -m pddlink`` is the ``pddlink`` command."""

from pddlink.cli.main import main

main()
