"""The sparse selection format shared by every method and every kernel.

It lives with the kernels (``raysparse.kernels.selection``), which take it and must not import the methods;
this module keeps the methods' import path.
"""

from raysparse.kernels.selection import (
    SENTINEL,
    BlockSelection,
    TokenSelection,
    block_pairs,
    indices_from_mask,
    mask_from_indices,
    packed_block_pairs,
    pad_sorted,
    topk_mask,
)

__all__ = ["SENTINEL", "BlockSelection", "TokenSelection", "block_pairs", "indices_from_mask", "mask_from_indices",
           "packed_block_pairs", "pad_sorted", "topk_mask"]
