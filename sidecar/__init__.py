"""The per-pod sidecar: engine metric readers, readiness state, drain loop, HTTP endpoints."""
