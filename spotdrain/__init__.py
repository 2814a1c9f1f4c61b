"""Shared core of spotdrain's two programs: settings, logging, metrics, HTTP helpers, Kubernetes access."""
