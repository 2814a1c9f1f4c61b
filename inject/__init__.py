"""``spotdrain inject``: add the sidecar and its handshake to the inference workloads of a manifest."""
