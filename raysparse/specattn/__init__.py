"""SpecAttn (papers/specattn.md, SPEC section 4): self-speculative decoding whose verifier attends only the
context chunks the draft's attention points at.

- ``draft``: the draft is the verifier with a subset of its layers, sharing its KV cache.
- ``layer_map``: verifier layer -> draft layer by monotone DTW over attention KL; JSON next to the model;
  ``specattn_map_main`` is the ``raysparse specattn-map`` command.
- ``topp``: sorting-free top-p (fixed 10-step threshold bisection), union over steps, 16-token chunks.
- ``method``: the ``specattn`` registry entry (``SpecAttn``, marker ``speculative = True``), the verifier's
  sparse attention and its KV-reduction / acceptance statistics.
- ``decode``: ``SpecAttnGenerator``, the Generator-compatible speculative decoding loop.
"""

from raysparse.specattn.decode import SpecAttnGenerator
from raysparse.specattn.layer_map import (
    LayerMap,
    compute_layer_map,
    load_layer_map,
    monotone_dtw,
    resolve_layer_map,
    save_layer_map,
    specattn_map_main,
)
from raysparse.specattn.method import SpecAttn, SpecAttnConfig, SpecAttnStats
from raysparse.specattn.topp import round_to_chunks, topp_mask

__all__ = ["LayerMap", "SpecAttn", "SpecAttnConfig", "SpecAttnGenerator", "SpecAttnStats", "compute_layer_map",
           "load_layer_map", "monotone_dtw", "resolve_layer_map", "round_to_chunks", "save_layer_map",
           "specattn_map_main", "topp_mask"]
