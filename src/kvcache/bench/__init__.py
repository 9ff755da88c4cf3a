"""Benchmarks: kvcache beside its peers, measured in the same run."""
