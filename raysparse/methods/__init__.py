"""Sparse attention methods and their registry."""
