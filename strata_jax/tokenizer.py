"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) and the byte-level tiny default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.sandbox

from strata_jax.api import InvalidRequestError


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; BOS and EOS follow.  Needs no files."""

    BOS = 256
    EOS = 257
    vocab_size = 258

    def __init__(self) -> None:
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in _checked_messages(messages))
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, chat template from ``tokenizer_config.json``."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as RawTokenizer

        folder = Path(folder)
        self._tok = RawTokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = () if eos_id is None else (eos_id,)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        messages = _checked_messages(messages)
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer_config.json has no chat_template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise InvalidRequestError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content")
    return token if isinstance(token, str) else None


def _checked_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError("each message needs a string 'role' and a string 'content'")
    return messages


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, holding back incomplete characters."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self._tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self.ids)
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
