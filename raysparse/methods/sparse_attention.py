"""Reference attention over a selection, by gathering: the oracle the Triton kernels are tested against.

The functions live with the kernels (``raysparse.kernels.reference``), whose CPU fallback they are; this
module keeps the methods' import path.
"""

from raysparse.kernels.reference import block_sparse_attention, combine, sparse_decode_attention

__all__ = ["block_sparse_attention", "combine", "sparse_decode_attention"]
