"""The CUDA caching allocator's rules, replayed over the allocation events of a fake run.

Allocations round up to 512 bytes; requests up to 1 MiB come from 2 MiB segments (small pool), larger ones
from 20 MiB segments, and requests of 10 MiB or more get their own segment rounded up to 2 MiB. Free blocks
are reused best-fit and split; segments are never returned (no `empty_cache` in a training loop).
Constants live in profiles/measurements/cuda_constants.json with where they came from.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import profiles


def _constants_path() -> Path:
    return profiles.PROFILES_DIR / "measurements" / "cuda_constants.json"


CONSTANTS_PATH = _constants_path()


@lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    return json.loads(CONSTANTS_PATH.read_text())


@dataclass(frozen=True)
class AllocatorPeaks:
    allocated: int  # max_memory_allocated: rounded sizes
    reserved: int  # max_memory_reserved: segments


def round_size(n: int, quantum: int = 512) -> int:
    return max(quantum, (n + quantum - 1) // quantum * quantum)


class _Block:
    __slots__ = ("seg", "offset", "size", "free", "prev", "next")

    def __init__(self, seg: int, offset: int, size: int) -> None:
        self.seg, self.offset, self.size, self.free = seg, offset, size, True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.seg, self.offset)


class _Pool:
    """Segments of one pool as linked blocks; the free blocks in one list sorted by (size, segment, offset), so
    best fit (the smallest block that fits, the oldest segment and lowest offset among equals) is one bisect."""

    def __init__(self, small: bool, c: dict[str, int]) -> None:
        self.small = small
        self.c = c
        self.segments = 0
        self.reserved = 0
        self._free: list[tuple[int, int, int]] = []
        self._blocks: dict[tuple[int, int], _Block] = {}  # (segment, offset) -> free block

    def _add_free(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free, b.key())
        self._blocks[(b.seg, b.offset)] = b

    def _drop_free(self, b: _Block) -> None:
        k = b.key()
        del self._free[bisect.bisect_left(self._free, k)]
        del self._blocks[(b.seg, b.offset)]
        b.free = False

    def alloc(self, size: int) -> _Block:
        i = bisect.bisect_left(self._free, (size, -1, -1))
        if i == len(self._free):
            seg_size = self._segment_size(size)
            b = _Block(self.segments, 0, seg_size)
            self.segments += 1
            self.reserved += seg_size
            self._add_free(b)
            i = bisect.bisect_left(self._free, b.key())
        bsize, seg, offset = self._free[i]
        b = self._blocks[(seg, offset)]
        self._drop_free(b)
        rest = bsize - size
        min_split = self.c["round_bytes"] if self.small else self.c["small_size_bytes"] + 1
        if rest >= min_split:
            tail = _Block(seg, offset + size, rest)
            tail.prev, tail.next = b, b.next
            if b.next is not None:
                b.next.prev = tail
            b.next = tail
            b.size = size
            self._add_free(tail)
        return b

    def free(self, b: _Block) -> None:
        nxt = b.next
        if nxt is not None and nxt.free:
            self._drop_free(nxt)
            b.size += nxt.size
            b.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = b
        prv = b.prev
        if prv is not None and prv.free:
            self._drop_free(prv)
            prv.size += b.size
            prv.next = b.next
            if b.next is not None:
                b.next.prev = prv
            b = prv
        self._add_free(b)

    def _segment_size(self, size: int) -> int:
        c = self.c
        if self.small:
            return c["small_segment_bytes"]
        if size < c["min_large_alloc_bytes"]:
            return c["large_segment_bytes"]
        return round_size(size, c["round_large_bytes"])


def replay(events: list[tuple[int, int]], *, expandable_segments: bool, base_bytes: int = 0) -> AllocatorPeaks:
    """Peak allocated and reserved bytes of `events` ((key, +size) / (key, -size) in time order).

    With expandable segments, each pool is one segment that grows in 2 MiB pages: reserved is the high-water
    mark of the rounded bytes in use, rounded up to the page (fragmentation inside it is not modelled).
    """
    c = constants()["allocator"]
    pools = {True: _Pool(True, c), False: _Pool(False, c)}
    where: dict[int, tuple[bool, _Block | None, int]] = {}
    allocated = peak_alloc = peak_reserved = 0
    in_use = {True: 0, False: 0}
    page = c["round_large_bytes"]
    for key, delta in events:
        if delta > 0:
            size = round_size(delta, c["round_bytes"])
            small = size <= c["small_size_bytes"]
            allocated += size
            if expandable_segments and not small:
                in_use[False] += size
                where[key] = (small, None, size)
            else:
                where[key] = (small, pools[small].alloc(size), size)
        else:
            small, block, size = where.pop(key)
            allocated -= size
            if block is None:
                in_use[False] -= size
            else:
                pools[small].free(block)
        peak_alloc = max(peak_alloc, allocated)
        large = -(-in_use[False] // page) * page if expandable_segments else 0
        peak_reserved = max(peak_reserved, pools[True].reserved + pools[False].reserved + large)
    return AllocatorPeaks(allocated=peak_alloc + base_bytes, reserved=peak_reserved + base_bytes)


# The caching allocator's reserved over allocated at the peak (fragmentation), with and without expandable segments:
# the closed form where no allocation stream is replayed (the estimate; the simulator's online RL run, which records
# none). Moved here from advisor/estimator/memory.py, which re-exports it.
RESERVED_FACTOR = {True: 1.02, False: 1.10}


def context_bytes(compute_capability: str | None, cuda_major: int | None = None) -> int:
    """What a training process holds on the device outside the caching allocator (the CUDA context, the kernel modules
    loaded, the cuBLAS handles), measured per CUDA major and compute capability (`cuda_context_bytes.measured`).

    `cuda_major`: the CUDA major the run uses; None: the local torch build's. Unknown (a build without CUDA): the
    newest CUDA major measured for that compute capability. No measurement matches: the (unverified) default."""
    ctx = constants()["cuda_context_bytes"]
    if not compute_capability:
        return int(ctx["default"])
    sm = f"sm{compute_capability.replace('.', '')}"
    measured = ctx.get("measured", {})
    major = local_cuda_major() if cuda_major is None else cuda_major
    if major is not None:
        entry = measured.get(f"cuda{major}", {}).get(sm)
    else:
        majors = sorted((int(k.removeprefix("cuda")) for k, v in measured.items() if sm in v), reverse=True)
        entry = measured[f"cuda{majors[0]}"][sm] if majors else None
    return int(entry["bytes"] if entry else ctx["default"])


def cublas_workspace_bytes(compute_capability: str | None, threads: int | None = None) -> int:
    """The cuBLAS workspaces a training process holds: one per thread issuing GEMMs (`threads`; default the training
    step's: the forward's Python thread and autograd's device thread)."""
    ws = constants()["cublas_workspace_bytes"]
    one = ws["sm90"] if compute_capability and compute_capability.startswith("9") else ws["default"]
    return int(one) * int(ws["threads"] if threads is None else threads)


@lru_cache(maxsize=1)
def local_cuda_major() -> int | None:
    """The CUDA major version the installed torch was built for (torch.version.cuda), None for a build without CUDA.
    Read from torch/version.py when torch is not imported yet (the estimate does not import it)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.version.cuda
    else:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        m = re.search(r"^cuda\b[^=]*=\s*'([^']*)'", text, re.MULTILINE)
        version = m.group(1) if m else None
    return int(version.split(".")[0]) if version else None
