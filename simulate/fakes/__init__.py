"""Fakes that behave like the real servers, for the tests and ``spotdrain simulate``."""
