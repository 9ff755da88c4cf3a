"""Measuring instruments that look inside the cache: the KV size calculator."""
