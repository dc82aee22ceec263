"""``raysparse bench``: a gRPC load generator with vLLM ``bench serve`` metrics, a prompt-length sweep and a
multi-node scaling mode."""
