"""raysparse: long-context LLM inference with training-free sparse attention on Ray."""

__version__ = "0.1.0"
