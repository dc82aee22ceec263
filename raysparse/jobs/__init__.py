"""Batch workloads for ``ray job submit``."""
