"""The client conformance suite (docs/clients.md)."""
