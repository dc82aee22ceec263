"""SpecAttn (docs/methods/specattn.md): self-speculative decoding whose verifier attends only the
context chunks the draft's attention points at.

- ``draft``: the draft is the verifier with a subset of its layers, sharing its KV cache.
- ``layer_map``: the map verifier layer -> draft layer (``LayerMap``) and its fallbacks.
- ``map_engine``: the layer map measured on the engine's shard actors, for ``raysparse specattn-map``
  (``raysparse/cli/specattn_map.py``; not imported here: it starts an engine).
- ``dtw``: monotone DTW over -KL similarities of attention rows.
- ``map_measure``: the map measured on real text (probed attention rows, similarity sums, DTW).
- ``map_store``: the map's JSON next to the model (or in the cache) and its serve-time lookup.
- ``topp``: sorting-free top-p (fixed 10-step threshold bisection), union over steps, 16-token chunks.
- ``method``: the ``specattn`` registry entry (``SpecAttn``, marker ``speculative = True``).
- ``verify``: the verifier's sparse attention (verification plan, batched and reference paths).
- ``stats``: its KV-reduction / acceptance statistics (``SpecAttnStats``).
- ``decode``: ``SpecAttnGenerator``, the Generator-compatible speculative decoding loop.
"""

from raysparse.specattn.decode import SpecAttnGenerator
from raysparse.specattn.dtw import monotone_dtw
from raysparse.specattn.layer_map import LayerMap
from raysparse.specattn.map_measure import compute_layer_map
from raysparse.specattn.map_store import load_layer_map, resolve_layer_map, save_layer_map
from raysparse.specattn.method import SpecAttn, SpecAttnConfig
from raysparse.specattn.stats import SpecAttnStats
from raysparse.specattn.topp import round_to_chunks, topp_mask

__all__ = ["LayerMap", "SpecAttn", "SpecAttnConfig", "SpecAttnGenerator", "SpecAttnStats", "compute_layer_map",
           "load_layer_map", "monotone_dtw", "resolve_layer_map", "round_to_chunks", "save_layer_map",
           "topp_mask"]
