"""Registered memory for the TCP transport: bounds checks and zero-copy views.

Invariants
----------
- A `RegionTable` is immutable; registering more memory builds a new table, so a
  reader (the loop thread) always sees a consistent one without locking.
- Its spans are the union of the registered regions, sorted and disjoint, with
  touching or overlapping regions merged. A byte range is accepted iff it lies
  inside one span, i.e. iff every byte of it was registered.
- Views are `memoryview`s straight over the registered addresses (ctypes); no
  copy is ever made. The caller keeps registered memory alive until the
  transport is closed.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable

import numpy as np

# Addresses and sizes above this are refused before any arithmetic, so the
# int64 math below cannot overflow (user-space addresses are < 2**57).
_ADDR_LIMIT = 1 << 62
_SMALL = 32  # up to this many ranges, check with plain ints


class OutOfBounds(ValueError):
    """A byte range is not inside registered memory."""


class RegionTable:
    """The union of registered regions, as sorted disjoint spans."""

    def __init__(self, regions: Iterable[tuple[int, int]] = ()) -> None:
        pairs = sorted((int(a), int(n)) for a, n in regions if int(n) > 0)
        for a, n in pairs:
            if a <= 0 or a >= _ADDR_LIMIT or n >= _ADDR_LIMIT:
                raise ValueError(f"invalid region (address {a:#x}, {n} bytes)")
        spans: list[list[int]] = []
        for a, n in pairs:
            if spans and a <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], a + n)
            else:
                spans.append([a, a + n])
        self.regions: tuple[tuple[int, int], ...] = tuple(pairs)
        self.bases = np.array([s[0] for s in spans], dtype=np.int64)
        self.ends = np.array([s[1] for s in spans], dtype=np.int64)
        self._bases = [s[0] for s in spans]
        self._ends = [s[1] for s in spans]
        self._views = [
            memoryview((ctypes.c_ubyte * (e - b)).from_address(b)).cast("B") for b, e in spans
        ]

    def with_regions(self, regions: Iterable[tuple[int, int]]) -> RegionTable:
        return RegionTable([*self.regions, *regions])

    def __len__(self) -> int:
        return len(self._views)

    def locate(self, addrs: np.ndarray, lens: np.ndarray) -> list[int]:
        """Index of the span holding each range `[addr, addr + len)` (len > 0).

        Raises OutOfBounds naming the first offending range."""
        if len(addrs) <= _SMALL:  # plain ints: exact, and cheaper than numpy here
            return self._locate_small(np.asarray(addrs).tolist(), np.asarray(lens).tolist())
        a, n = np.asarray(addrs), np.asarray(lens)
        if (a.astype(np.uint64) >= _ADDR_LIMIT).any() or (n.astype(np.uint64) >= _ADDR_LIMIT).any():
            raise OutOfBounds("address or size out of range")
        a, n = a.astype(np.int64), n.astype(np.int64)
        idx = np.searchsorted(self.bases, a, side="right") - 1
        ok = (idx >= 0) & (n > 0)
        if len(self):
            ok &= a + n <= self.ends[np.maximum(idx, 0)]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise OutOfBounds(_describe(int(a[i]), int(n[i]), i))
        return idx.tolist()

    def _locate_small(self, addrs: list[int], lens: list[int]) -> list[int]:
        bases, ends, out = self._bases, self._ends, []
        for row, (a, n) in enumerate(zip(addrs, lens, strict=True)):
            i = bisect.bisect_right(bases, a) - 1
            if i < 0 or n <= 0 or a + n > ends[i]:
                raise OutOfBounds(_describe(a, n, row))
            out.append(i)
        return out

    def views(self, addrs: np.ndarray, lens: np.ndarray) -> list[memoryview]:
        """Writable views over each range, after checking all of them first."""
        idx = self.locate(addrs, lens)
        bases, views = self._bases, self._views
        return [
            views[s][a - bases[s] : a - bases[s] + n]
            for s, a, n in zip(
                idx, np.asarray(addrs).tolist(), np.asarray(lens).tolist(), strict=True
            )
        ]


def _describe(addr: int, nbytes: int, row: int) -> str:
    return f"range {addr:#x}+{nbytes} (row {row}) is not in registered memory"


def merge_runs(addrs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge consecutive ranges where one starts exactly where the previous ended.

    Order is kept; the concatenation of the bytes covered is unchanged."""
    addrs = np.asarray(addrs, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    if len(addrs) < 2:
        return addrs, lens
    starts = np.flatnonzero(np.r_[True, addrs[1:] != addrs[:-1] + lens[:-1]])
    return addrs[starts], np.add.reduceat(lens, starts)


def merge_rows(descs: np.ndarray) -> np.ndarray:
    """Merge consecutive `(src, dst, nbytes)` rows contiguous in both src and dst."""
    if len(descs) < 2:
        return descs
    src, dst, n = descs[:, 0], descs[:, 1], descs[:, 2]
    cont = (src[1:] == src[:-1] + n[:-1]) & (dst[1:] == dst[:-1] + n[:-1])
    starts = np.flatnonzero(np.r_[True, ~cont])
    out = descs[starts].copy()
    out[:, 2] = np.add.reduceat(n, starts)
    return out
