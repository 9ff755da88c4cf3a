"""Requests, model runner, sampler, sessions."""
