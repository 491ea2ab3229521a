"""Synchronous device code: model, attention, sampler, executor. Never imports trio."""
