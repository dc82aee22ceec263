"""Reading a safetensors checkpoint part by part, so a tensor-parallel rank reads only its own slices.

A local Hugging Face directory keeps its weights in ``model.safetensors``, or in shards listed by
``model.safetensors.index.json`` (tensor name to file). ``read_parts`` takes each tensor's part for a rank
(``tensor_parallel.shard_plan``) through ``safetensors.safe_open(...).get_slice(...)``: the slice is a view
of the memory-mapped file, so only the pages under the part are read from disk, and it is copied out at
once in the model's dtype onto the model's device. Each tensor's file is opened for that tensor alone, so
mapped pages never outlive one tensor: the host holds the rank's part of the model (nothing, once it is on
a GPU) plus one tensor's part at a time, never the whole model.

``LoadStats`` says what loading cost a rank: the bytes of tensors it read against the checkpoint's, and the
process's peak resident memory while loading (``PeakHostMemory``). The bytes are those of the parts copied
out; the OS reads whole pages (and reads ahead), so a row-parallel part of rows narrower than a page brings
in a little more than it counts.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# (dim, start, end) of the full tensor, or None for all of it (``tensor_parallel.Part``)
Part = tuple[int, int, int] | None


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors (``dtype``, ``shape``, ``data_offsets``) from its JSON header alone."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (a {n}-byte header)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_map(directory: Path) -> dict[str, str] | None:
    """Tensor name -> file name of the directory's safetensors weights; None when it has none."""
    index = directory / INDEX_FILE
    if index.is_file():
        wmap = json.loads(index.read_text()).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise ValueError(f"{index} has no weight_map")
        absent = sorted({f for f in wmap.values() if not (directory / f).is_file()})
        if absent:
            raise FileNotFoundError(f"{index} lists {absent[0]!r}, which is not in {directory}")
        return {str(k): str(v) for k, v in wmap.items()}
    single = directory / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(read_header(single), SINGLE_FILE)
    return None


def checkpoint_bytes(directory: Path, files: set[str] | list[str]) -> int:
    """Bytes of every tensor in these files of the checkpoint (from the headers, nothing mapped)."""
    return sum(end - start for f in files for start, end in
               (t["data_offsets"] for t in read_header(directory / f).values()))


def _slice(view: Any, part: Part) -> torch.Tensor:
    if part is None:
        return view[:]
    dim, lo, hi = part
    return view[lo:hi] if dim == 0 else view[(slice(None),) * dim + (slice(lo, hi),)]


def read_parts(directory: Path, wmap: Mapping[str, str], plan: Mapping[str, Part], dtype: torch.dtype,
               device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], int, set[str]]:
    """Each planned tensor's part, read by ``get_slice`` and copied out as a contiguous ``dtype`` tensor on
    ``device``. Returns (tensors, bytes read, files opened). Raises ValueError naming tensors the plan needs
    and the checkpoint lacks."""
    missing = [n for n in plan if n not in wmap]
    if missing:
        raise ValueError(f"checkpoint does not match the Llama layout: missing={missing[:5]}")
    state: dict[str, torch.Tensor] = {}
    read, files = 0, set()
    for name, part in plan.items():
        file = wmap[name]
        with safe_open(str(directory / file), framework="pt", device="cpu") as f:
            view = _slice(f.get_slice(name), part)
            read += view.numel() * view.element_size()
            state[name] = torch.empty(view.shape, dtype=dtype, device=device).copy_(view)
            del view  # the last reference to the file's mapping goes with it
        files.add(file)
    return state, read, files


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


class PeakHostMemory:
    """This process's resident memory at the start of a span and its peak within it. Linux resets the peak
    (VmHWM) when 5 is written to /proc/self/clear_refs; where that is refused, the peak is the process's
    lifetime peak (``exact`` False), which is still an upper bound."""

    def __enter__(self) -> PeakHostMemory:
        self.before = _status_bytes("VmRSS") or 0
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = _status_bytes("VmHWM") is not None
        except OSError:
            self.exact = False
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def peak(self) -> int:
        hwm = _status_bytes("VmHWM") if self.exact else None
        return max(hwm if hwm is not None else _lifetime_peak(), self.before)


@dataclass(frozen=True)
class LoadStats:
    """What loading its part of the model cost one rank. ``source``: ``safetensors`` (its parts read by
    slicing), ``whole`` (weights that cannot be sliced on read, such as ``pytorch_model.bin``, loaded whole
    by transformers and then sliced) or ``random`` (no checkpoint read)."""

    source: str
    rank: int
    world_size: int
    bytes_read: int  # bytes of checkpoint tensors this rank read
    checkpoint_bytes: int  # bytes of every tensor in the checkpoint
    tensors: int  # tensors (or parts of tensors) read
    files: int  # checkpoint files opened
    host_rss_before_bytes: int  # the process's resident memory when loading began
    host_peak_bytes: int  # its peak while loading (``PeakHostMemory``)
    host_peak_exact: bool  # False: the process's lifetime peak stands in
    seconds: float

    @property
    def read_fraction(self) -> float:
        return self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "read_fraction": self.read_fraction}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoadStats:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def summary(self) -> str:
        mb = 2**20
        return (f"rank {self.rank}/{self.world_size} ({self.source}) read {self.bytes_read / mb:.1f} of "
                f"{self.checkpoint_bytes / mb:.1f} MiB of weights ({100 * self.read_fraction:.0f}%) from "
                f"{self.files} file(s) in {self.seconds:.1f} s; peak host memory {self.host_peak_bytes / mb:.0f} MiB "
                f"(+{(self.host_peak_bytes - self.host_rss_before_bytes) / mb:.0f} MiB while loading)")


def weight_files(directory: Path) -> list[Path]:
    """The directory's weight files that are not safetensors (``*.bin``, ``*.pt``, ``*.pth``)."""
    return sorted(p for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth") and p.is_file()
                  and not p.name.startswith("training_args"))


__all__ = ["INDEX_FILE", "SINGLE_FILE", "LoadStats", "PeakHostMemory", "checkpoint_bytes", "read_header",
           "read_parts", "weight_files", "weight_map"]
