"""Decode batch buckets: the few batch sizes a decode step is made for (runtime.decode_buckets).

A decode step computes every row of its batch, used or not, so a server holding one sequence in
an engine of max_batch=16 would pay for sixteen. Instead each bucket b is its own static step over
rows 0..b-1 (views caches[:b] of every cache field: they are batch first), and a step runs the
smallest bucket that holds the rows in use. Each bucket is one more graph per layer structure
(compiled regions), one more package per structure (aot) or one more capture (CUDA graph), all
made by warmup, so a few sizes (powers of two) keep warmup short while no step computes more than
twice the rows it needs.

    default_buckets(max_batch) -> (1, 2, 4, ..., max_batch)
    check_buckets(buckets, max_batch) -> the sizes as a sorted tuple (or a clear error)
    bucket_for(buckets, n) -> the smallest bucket >= n
"""
from __future__ import annotations

from typing import Iterable, Optional


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, then max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def check_buckets(buckets: Optional[Iterable[int]], max_batch: int, what: str = "decode_buckets") -> tuple[int, ...]:
    """The bucket sizes (None: default_buckets) as an increasing tuple whose last is max_batch;
    anything else is refused naming `what` and the value."""
    if buckets is None:
        return default_buckets(max_batch)
    sizes = list(buckets)
    if (not sizes or any(not isinstance(b, int) or isinstance(b, bool) for b in sizes)
            or sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] != max_batch):
        raise ValueError(f"{what}={sizes!r}: expected increasing batch sizes in 1..max_batch={max_batch} ending "
                         f"with max_batch (e.g. {list(default_buckets(max_batch))}), or null for those")
    return tuple(sizes)


def bucket_for(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket holding n rows (buckets end with max_batch; n <= max_batch)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest decode bucket {buckets[-1]}")
