"""The pddlink sidecar daemon: engine-facing gRPC, peer data plane, router service, metrics."""
