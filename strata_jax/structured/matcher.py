"""A request's grammar state on the engine's host side: the llguidance matcher and its
next-token mask (one bit per token id, packed in int32 words, as the device applies it).

Closing a JSON value in time: nothing in a JSON grammar bounds a string or a nesting
depth, and a small model can write one string until ``max_tokens`` runs out (seen with
SmolLM2-135M: a "date" value of ``00:00:00:...``), which would leave unparseable output.
In the last ``CLOSING_WINDOW`` tokens of its budget a JSON-constrained request may only
use tokens made of closing characters (``"``, ``}``, ``]``) when the grammar allows one,
and of those only the ones that close the most: a completed value first, else the
fewest open strings, objects and arrays after it (tracked from the text so far; inside
a string a ``}`` is text, a ``"}`` closes two things), so it closes its strings, objects
and arrays instead of running out (unless it is nested deeper than the window).

``GrammarTokenizer`` adapts the engine's tokenizer once per engine (a Hugging Face
``tokenizers`` tokenizer directly, the byte-level tiny one through llguidance's
``TokenizerWrapper``), sized to the model's vocabulary: ids the tokenizer does not have
are never allowed.  ``GrammarState`` is made in the caller's thread at submit (building
a matcher may take milliseconds for a large schema) and used on the engine thread only.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from strata_jax.api import InvalidRequestError
from strata_jax.structured.spec import StructuredOutput
from strata_jax.tokenizer import Tokenizer


@runtime_checkable
class _ByteLevel(Protocol):
    """The byte-level tokenizer (``tokenizer.ByteTokenizer``) as ``_ByteVocabulary`` reads it."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def byte_tokens(self) -> list[bytes]: ...


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


CLOSING_WINDOW = 32
_CLOSING_CHARS = frozenset('"}]')


class GrammarTokenizer:
    """The engine's tokenizer as llguidance sees it (built once; ~1 s for a 50K vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.eos = [i for i in eos_token_ids if i < vocab_size]
        self.closers, self.closer_text = _closing_tokens(tokenizer, vocab_size)
        self._tokenizer = tokenizer
        raw = getattr(tokenizer, "raw_tokenizer", None)
        if raw is not None:  # HFTokenizer: the tokenizers library's own JSON
            self.ll = llguidance.LLTokenizer(raw.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        elif isinstance(tokenizer, _ByteLevel):  # has ``byte_tokens`` (and the ids it reads)
            self.ll = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)), n_vocab=vocab_size
            )
        else:
            raise InvalidRequestError("structured outputs need a tokenizer this server can hand to its grammar engine")

    def text(self, token: int) -> str:
        """One token's text (closing tokens are known; others decoded on demand)."""
        hit = self.closer_text.get(token)
        if hit is None:
            hit = self._tokenizer.decode([token])
        return hit


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` asks of a tokenizer, for the byte-level one."""

    def __init__(self, tokenizer: _ByteLevel) -> None:
        self.tokens = tokenizer.byte_tokens()
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in (tokenizer.bos_token_id, *tokenizer.eos_token_ids) if i is not None]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _closing_tokens(tokenizer: Tokenizer, vocab_size: int) -> tuple[np.ndarray, dict[int, str]]:
    """Ids whose text is only closing characters of JSON (``"``, ``}``, ``]``), and their texts."""
    found: dict[int, str] = {}
    for i in range(min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))):
        try:
            text = tokenizer.decode([i])
        except Exception:  # an id the tokenizer cannot decode alone is no closer
            continue
        if text and set(text) <= _CLOSING_CHARS:
            found[i] = text
    return np.asarray(sorted(found), np.int64), found


def json_scan(state: tuple[bool, bool, int], text: str) -> tuple[bool, bool, int]:
    """(in a string, after a backslash, open objects + arrays) after ``text`` (JSON, any prefix)."""
    in_string, escaped, depth = state
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_string, escaped, depth


class GrammarState:
    """One request's matcher and its mask for the next token.

    ``budget``: tokens the request may generate (its ``max_tokens``, or less if the
    context ends first); JSON constraints close within it (module doc).
    """

    def __init__(self, spec: StructuredOutput, tokenizer: GrammarTokenizer, budget: int | None = None) -> None:
        import llguidance

        self.spec = spec
        self.matcher = llguidance.LLMatcher(tokenizer.ll, spec.grammar(), log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(f"{spec.field}: {self.matcher.get_error()}")
        self.mask = np.full(mask_words(tokenizer.vocab_size), -1, np.int32)
        self.budget = budget
        self.consumed = 0
        self._tokenizer = tokenizer
        self._closers = tokenizer.closers if spec.closes_json else None
        self._json = (False, False, 0)  # json_scan state of the output so far
        self.refresh()

    def refresh(self) -> None:
        """Compute the mask of the tokens allowed next (in place)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.mask.reshape(1, -1), 0)
        if self._closers is not None and self.budget is not None and self.budget - self.consumed <= CLOSING_WINDOW:
            self._close()

    def _close(self) -> None:
        """Near the end of the budget: stop if the grammar may; else only closing tokens, when it allows any."""
        if self.matcher.is_accepting() and self._tokenizer.eos:
            keep = np.asarray(self._tokenizer.eos, np.int64)
            self.mask[:] = 0
            np.bitwise_or.at(self.mask, keep // 32, (np.int64(1) << (keep % 32)).astype(np.uint32).view(np.int32))
            return
        ids = self._closers
        if ids is None or not len(ids):  # None: not a JSON constraint (refresh does not call this then)
            return
        allowed = ids[((self.mask[ids // 32] >> (ids % 32)) & 1) != 0]
        if not len(allowed):
            return  # a value must come first (after a key, say): the model writes it
        ranked = []
        for token in allowed.tolist():
            probe = self.matcher.deep_copy()
            done = probe.consume_token(token) and (probe.is_accepting() or probe.is_stopped())
            in_string, _, depth = json_scan(self._json, self._tokenizer.text(token))
            ranked.append(((not done, in_string, depth), token))  # done first, then out of strings, then shallowest
        best = min(rank for rank, _ in ranked)
        keep = np.asarray([token for rank, token in ranked if rank == best], np.int64)
        self.mask[:] = 0
        np.bitwise_or.at(self.mask, keep // 32, (np.int64(1) << (keep % 32)).astype(np.uint32).view(np.int32))

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is done (the request should end)."""
        self.consumed += 1
        if self._closers is not None:
            self._json = json_scan(self._json, self._tokenizer.text(token))
        self.matcher.consume_token(token)
        if self.matcher.is_error():
            return True  # cannot happen under the mask; end rather than emit what no longer matches
        if self.matcher.is_stopped():
            return True
        self.refresh()
        return False

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
