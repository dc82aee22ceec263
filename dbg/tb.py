import sys, traceback
sys.path.insert(0, "tests")
import torch
import raysparse.shard_executor as se
orig = se.ShardExecutor._decode
def dec(self, plan, backend):
    try:
        return orig(self, plan, backend)
    except Exception:
        traceback.print_exc(limit=-12)
        raise
se.ShardExecutor._decode = dec
import test_kv_tiers_gpu as g
import test_kv_tiers_engine as e
from raysparse.loader import model_from_state
cfg, st = e.tiny(1)
m = model_from_state(cfg, st, dtype=torch.float32, device="cuda").eval()
with torch.no_grad():
    try:
        g._run(m, "streaming", 3, True, torch.float32, "rows", graphs=True)
    except AssertionError as x:
        print("AE", str(x)[:200])
