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


# An extend bucket of T tokens has room for T // EXTEND_TOKENS_PER_ROW sequences (the
# largest bucket for max_batch_size): prefill chunks average well over 8 tokens, and
# each row costs an LM-head row and a sampling row whether it is used or not.
EXTEND_TOKENS_PER_ROW = 8


def extend_rows(token_bucket: int, largest_token_bucket: int, max_batch_size: int) -> int:
    """Sequences (page-table rows) of the one extend program for ``token_bucket``.

    Always fewer than ``token_bucket`` (``T == B`` is the decode shape); the largest
    bucket holds ``max_batch_size`` so every batch the scheduler may form fits somewhere.
    """
    if token_bucket == largest_token_bucket:
        rows = max_batch_size
    else:
        rows = min(max_batch_size, max(1, token_bucket // EXTEND_TOKENS_PER_ROW))
    return min(rows, token_bucket - 1)
