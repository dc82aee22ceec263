import sys, traceback, collections
sys.path.insert(0, "tests")
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import raysparse.decode_graphs as dg
import test_kv_tiers_engine as e

seen = collections.Counter()
class Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if any(s in name for s in ("lift_fresh", "scalar_tensor", "_local_scalar_dense", "_to_copy", "copy_", "_copy_from", "empty.memory_format", "pin")):
            st = [f for f in traceback.extract_stack()[:-1] if "/raysparse/" in f.filename or "/kernels/" in f.filename]
            if st:
                f = st[-1]
                seen[(name, f.filename.split("main/")[-1], f.lineno, f.line)] += 1
        return func(*args, **kwargs)

orig = dg.DecodeGraphs._eager
def eager(self, *a, **k):
    with Mode():
        return orig(self, *a, **k)
dg.DecodeGraphs._eager = eager
cfg, st = e.tiny(1)
m = e.model_from_state(cfg, st).eval()
mode = sys.argv[1]
off = e.GRAPH_OFFLOAD if mode == "tier" else None
with torch.no_grad():
    e.run_method(m, "streaming", 3, off, separate=off is not None, graphs=True, admit=e.GRAPH_OFFLOAD, lens=e.GRAPH_LENS)
for k, v in sorted(seen.items()):
    print(v, k)
