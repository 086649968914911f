"""Serving code two programs share: HTTP, gRPC and TLS helpers, the sidecar protocol's generated
modules and their conversions, client keys and admin access, memory trimming. Below sidecar/ and
router/, imported by both (and by the CLI and the harness); imports no program."""
