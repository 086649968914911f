# The two commands of the README. Both set everything up first (idempotent) and then run.
.PHONY: demo test test-fleet lint setup

# Tests and the demo start `pddlink` subprocesses: the project's environment comes first on the PATH.
export PATH := $(CURDIR)/.venv/bin:$(PATH)

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/pddlink demo

# Two pytest processes side by side (scripts/test.sh): the vLLM and in-memory tests in one, the tests
# that start the project's other processes or netlab labs in the other.
test: setup lint
	scripts/test.sh

# The tests that start whole vLLM deployments of their own (marked `fleet`): minutes each here.
test-fleet: setup
	.venv/bin/python -m pytest -q --durations=25 -m fleet

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check pddlink engines_adapter sidecar router harness netlab tests
	.venv/bin/mypy pddlink sidecar router harness engines_adapter
