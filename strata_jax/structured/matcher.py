"""A request's grammar state on the engine's host side: the llguidance matcher and its
next-token mask (one bit per token id, packed in int32 words, as the device applies it).

``GrammarTokenizer`` adapts the engine's tokenizer once per engine (a Hugging Face
``tokenizers`` tokenizer directly, the byte-level tiny one through llguidance's
``TokenizerWrapper``), sized to the model's vocabulary: ids the tokenizer does not have
are never allowed.  ``GrammarState`` is made in the caller's thread at submit (building
a matcher may take milliseconds for a large schema) and used on the engine thread only.
"""

from __future__ import annotations

import numpy as np

from strata_jax.api import InvalidRequestError
from strata_jax.structured.spec import StructuredOutput


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarTokenizer:
    """The engine's tokenizer as llguidance sees it (built once; ~1 s for a 50K vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        raw = getattr(tokenizer, "raw_tokenizer", None)
        if raw is not None:  # HFTokenizer: the tokenizers library's own JSON
            self.ll = llguidance.LLTokenizer(raw.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        elif hasattr(tokenizer, "byte_tokens"):
            self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)), n_vocab=vocab_size)
        else:
            raise InvalidRequestError("structured outputs need a tokenizer this server can hand to its grammar engine")


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` asks of a tokenizer, for the byte-level one."""

    def __init__(self, tokenizer) -> None:
        self.tokens = tokenizer.byte_tokens()
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in (tokenizer.bos_token_id, *tokenizer.eos_token_ids) if i is not None]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarState:
    """One request's matcher and its mask for the next token."""

    def __init__(self, spec: StructuredOutput, tokenizer: GrammarTokenizer) -> None:
        import llguidance

        self.spec = spec
        self.matcher = llguidance.LLMatcher(tokenizer.ll, spec.grammar(), log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(f"{spec.field}: {self.matcher.get_error()}")
        self.mask = np.full(mask_words(tokenizer.vocab_size), -1, np.int32)
        self.refresh()

    def refresh(self) -> None:
        """Compute the mask of the tokens allowed next (in place)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.mask.reshape(1, -1), 0)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar is done (the request should end)."""
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
