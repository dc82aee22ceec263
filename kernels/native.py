"""The CPU's C kernels: each module's C source, compiled on first use with the host's compiler for its own
processor (``-march=native``) into the user's cache, and loaded through ctypes.

A library is keyed by its source, the flags and the processor's feature flags, so a change or another
processor builds anew, and it is written atomically, so processes that build it at once agree. It links
OpenMP by soname, which resolves to the ``libgomp.so.1`` PyTorch already loaded: its parallel loops run on
PyTorch's own thread pool, sized by ``torch.get_num_threads()``. Where no compiler works, ``load`` gives None
and the callers keep their PyTorch forms.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401 - loaded first, so the library's libgomp.so.1 is PyTorch's

# not -ffast-math: a library built with it flushes denormals to zero for the whole process when it loads
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
# exp for the kernels' softmax loops, inlined into them so they vectorise: without -ffast-math glibc declares no
# vector expf, and a scalar libm call per score cost three to four times the GEMMs around it. Cephes' expf (a
# degree-7 polynomial on r in [-ln2/2, ln2/2] after the Cody-Waite reduction x = k ln2 + r), scaled by 2^k through
# the exponent bits: within 2 ulp of expf; 0 below -87.3 (where expf is denormal or 0), -inf included.
VEC_EXP = r"""
#include <stdint.h>
#include <string.h>
static inline float rs_expf(float x) {
    float c = x > 88.3762626647949f ? 88.3762626647949f : x;
    c = c < -87.3365447504f ? -87.3365447504f : c;
    float kf = c * 1.44269504088896341f + 12582912.0f;  /* round to nearest by the float's own rounding */
    kf -= 12582912.0f;
    float r = c - kf * 0.693359375f;
    r = r + kf * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)kf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.3365447504f ? 0.0f : p * scale;
}
"""
# Eight-float vectors for dot-product loops over scattered rows (loaded unaligned), summed in a fixed order so a
# result does not depend on the build's vector width; PF: how many entries ahead such loops prefetch.
VEC8 = r"""
#include <string.h>
#define PF 2
typedef float v8f __attribute__((vector_size(32)));
static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum8(v8f v) {
    float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
    return a + b;
}
"""
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raysparse"


def _host_isa() -> str:
    """What ``-march=native`` compiles for: the processor's feature flags (a cache shared by nodes of different
    processors must not hand one node another's build)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(name: str, source: str) -> ctypes.CDLL | None:
    parts = [source, *FLAGS, sys.platform, os.uname().machine, _host_isa()]
    path = _cache_dir() / f"{name}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                obj = Path(tmp) / path.name
                subprocess.run([os.environ.get("CC", "cc"), *FLAGS, str(src), "-o", str(obj), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(obj, path)
        except (OSError, subprocess.SubprocessError):
            return None
    return ctypes.CDLL(str(path))


def load(name: str, source: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """The library ``name`` built from ``source``, once a process, its functions typed by ``signatures``
    (name: (argtypes, restype)); None where it cannot be built here."""
    if name not in _libs:
        with _lock:
            if name not in _libs:
                lib = _build(name, source)
                if lib is not None:
                    for fn, (args, res) in signatures.items():
                        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
                _libs[name] = lib
    return _libs[name]
