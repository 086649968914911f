"""The demo and the cluster harness: every role as its own process, replayed workloads."""
