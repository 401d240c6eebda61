"""The CUDA caching allocator's rules, replayed over the allocation events of a fake run.

Allocations round up to 512 bytes; requests up to 1 MiB come from 2 MiB segments (small pool), larger ones
from 20 MiB segments, and requests of 10 MiB or more get their own segment rounded up to 2 MiB. Free blocks
are reused best-fit and split; segments are never returned (no `empty_cache` in a training loop).
Constants live in profiles/measurements/cuda_constants.json with where they came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any


def _constants_path() -> Path:
    from ..profiles import PROFILES_DIR

    return PROFILES_DIR / "measurements" / "cuda_constants.json"


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


class _Segment:
    __slots__ = ("blocks",)

    def __init__(self, size: int) -> None:
        self.blocks: list[list[int]] = [[0, size, 1]]  # [offset, size, free]


class _Pool:
    def __init__(self, small: bool, c: dict[str, int]) -> None:
        self.small = small
        self.c = c
        self.segments: list[_Segment] = []
        self.reserved = 0

    def alloc(self, size: int) -> tuple[_Segment, int]:
        best: tuple[int, _Segment, int] | None = None
        for seg in self.segments:
            for i, (_, bsize, free) in enumerate(seg.blocks):
                if free and bsize >= size and (best is None or bsize < best[0]):
                    best = (bsize, seg, i)
        if best is None:
            seg = _Segment(self._segment_size(size))
            self.segments.append(seg)
            self.reserved += seg.blocks[0][1]
            best = (seg.blocks[0][1], seg, 0)
        bsize, seg, i = best
        offset = seg.blocks[i][0]
        rest = bsize - size
        min_split = self.c["round_bytes"] if self.small else self.c["small_size_bytes"] + 1
        if rest >= min_split:
            seg.blocks[i] = [offset, size, 0]
            seg.blocks.insert(i + 1, [offset + size, rest, 1])
        else:
            seg.blocks[i][2] = 0
        return seg, offset

    def free(self, seg: _Segment, offset: int) -> None:
        i = next(j for j, b in enumerate(seg.blocks) if b[0] == offset)
        seg.blocks[i][2] = 1
        if i + 1 < len(seg.blocks) and seg.blocks[i + 1][2]:
            seg.blocks[i][1] += seg.blocks.pop(i + 1)[1]
        if i > 0 and seg.blocks[i - 1][2]:
            seg.blocks[i - 1][1] += seg.blocks.pop(i)[1]

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
    where: dict[int, tuple[bool, _Segment, int, int]] = {}
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
                where[key] = (small, None, 0, size)  # type: ignore[arg-type]
            else:
                seg, off = pools[small].alloc(size)
                where[key] = (small, seg, off, size)
        else:
            small, seg, off, size = where.pop(key)
            allocated -= size
            if seg is None:
                in_use[False] -= size
            else:
                pools[small].free(seg, off)
        peak_alloc = max(peak_alloc, allocated)
        large = -(-in_use[False] // page) * page if expandable_segments else 0
        peak_reserved = max(peak_reserved, pools[True].reserved + pools[False].reserved + large)
    return AllocatorPeaks(allocated=peak_alloc + base_bytes, reserved=peak_reserved + base_bytes)


def context_bytes(compute_capability: str | None) -> int:
    """The CUDA context (outside PyTorch's allocator); a measured `sm<cc>` entry wins over the default."""
    ctx = constants()["cuda_context_bytes"]
    key = f"sm{compute_capability.replace('.', '')}" if compute_capability else None
    return int(ctx.get(key, ctx["default"]) if key else ctx["default"])


def cublas_workspace_bytes(compute_capability: str | None) -> int:
    ws = constants()["cublas_workspace_bytes"]
    if compute_capability and compute_capability.startswith("9"):
        return int(ws["sm90"])
    return int(ws["default"])


