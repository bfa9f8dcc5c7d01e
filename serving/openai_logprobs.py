"""OpenAI's logprobs shapes, built from the engine's ``TokenLogprob`` lists.

Completions (legacy) ``logprobs``::

    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}

``top_logprobs[i]`` holds the N most likely tokens at position i plus the token
chosen there (so up to N + 1 entries, as OpenAI documents); with ``echo`` the
prompt's positions come first and the first one is ``None`` (nothing precedes it).

Chat ``logprobs``::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token": str, "logprob": float, "bytes": [int]}]}],
     "refusal": None}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from strata_jax.api import TokenLogprob

Decode = Callable[[int], str]


def token_text(decode: Decode) -> Decode:
    """A cached single-token decoder (tokens repeat a lot across positions)."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = decode(token_id)
        return cache[token_id]

    return text


class CompletionLogprobs:
    """Accumulates the completions shape; ``text_offset`` continues across ``add`` calls."""

    def __init__(self, decode: Decode, top_n: int, offset: int = 0) -> None:
        self.decode = decode
        self.top_n = top_n
        self.offset = offset

    def build(self, entries: Sequence[TokenLogprob | None], first_token_ids: Sequence[int] = ()) -> dict:
        """``entries`` in order; a ``None`` entry (the prompt's first token) takes its id
        from ``first_token_ids``."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pending_first = list(first_token_ids)
        for entry in entries:
            token_id = entry.token_id if entry is not None else pending_first.pop(0)
            text = self.decode(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            top = {self.decode(t): lp for t, lp in entry.top[: self.top_n]}
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
        return out


def merge_completion_logprobs(parts: Sequence[dict]) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode, top_n: int) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top[:top_n]]
        content.append(entry)
    return {"content": content, "refusal": None}


def mean_logprob(entries: Sequence[TokenLogprob]) -> float:
    """best_of ranks choices by log probability per token (OpenAI's definition)."""
    return sum(e.logprob for e in entries) / len(entries) if entries else 0.0
