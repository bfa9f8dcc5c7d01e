"""Static shape buckets: computed once at start-up, compiled at warm-up, looked up per step."""

from __future__ import annotations


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... up to and including ``maximum`` (appended if not a power)."""
    if minimum <= 0 or maximum < minimum:
        raise ValueError(f"bad bucket range [{minimum}, {maximum}]")
    buckets = []
    b = minimum
    while b < maximum:
        buckets.append(b)
        b *= 2
    buckets.append(maximum)
    return tuple(buckets)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
