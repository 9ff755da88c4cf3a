"""Fidelity of lossy caches against the full cache on the same model."""
