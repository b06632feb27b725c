"""Parallelism strategies: how ``ak.prepare`` wraps a model and how a step runs under it."""
