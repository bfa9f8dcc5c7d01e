"""Tokenizers: Hugging Face tokenizer files (as HF ships them) and the byte-level tiny default.

``HFTokenizer`` reads a model folder the way transformers >= 5 does:

* ``tokenizer.json`` (the ``tokenizers`` library) decides how text becomes ids, including
  which special tokens ``encode(text)`` adds (its post-processor).  ``add_bos_token`` /
  ``add_eos_token`` in ``tokenizer_config.json`` do not change it (transformers >= 5 ignores
  them when ``tokenizer.json`` exists); a mismatch is logged at load.
* ``tokenizer_config.json`` (or the legacy ``special_tokens_map.json``) names the special
  tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...), which chat
  templates see as variables; its ``added_tokens_decoder`` must agree with ``tokenizer.json``.
* chat templates come from ``chat_template.jinja`` / ``additional_chat_templates/`` /
  ``chat_template.json`` / ``tokenizer_config.json`` (see ``strata_jax.chat_template``),
  compiled at load so a broken one fails there, naming its file.

A chat prompt is rendered by the template, which writes its special tokens itself, so it
is encoded without adding any (``encode(text, add_special_tokens=False)``), as transformers'
``apply_chat_template(tokenize=True)`` and vLLM do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from strata_jax.api import InvalidRequestError
from strata_jax.chat_template import ChatTemplates, TokenizerFilesError, load_chat_templates, read_json_object

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str: ...

    def handles_tools(self, chat_template: str | None = None) -> bool: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; BOS and EOS follow.  Needs no files."""

    BOS = 256
    EOS = 257
    vocab_size = 258

    def __init__(self) -> None:
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def handles_tools(self, chat_template: str | None = None) -> bool:
        return False

    def byte_tokens(self) -> list[bytes]:
        """The bytes of every id (BOS and EOS as their names), for a grammar engine."""
        return [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """A fixed ``<|role|>`` layout (the tiny model has no template files; it renders no tools)."""
        messages = _checked_messages(messages)
        if chat_template is not None:
            raise InvalidRequestError(f"chat_template {chat_template!r}: the tiny model has no named chat templates")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        text = "".join(
            f"<|{m['role']}|>\n{m['content']}\n" for m in messages
        )  # tools: rendered into messages by the caller
        if continue_final_message:
            return text[: -len("\n")]
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class HFTokenizer:
    """A Hugging Face tokenizer folder: ``tokenizer.json`` + ``tokenizer_config.json`` + chat templates."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as RawTokenizer

        folder = Path(folder)
        self.folder = folder
        try:
            self._tok = RawTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise TokenizerFilesError(
                f"{folder / 'tokenizer.json'}: cannot be read by the tokenizers library: {exc}"
            ) from None
        config_file = folder / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        legacy_file = folder / "special_tokens_map.json"
        legacy = read_json_object(legacy_file) if legacy_file.is_file() else {}
        self._check_added_tokens(config, config_file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # name -> token text, for templates; tokenizer_config.json wins over special_tokens_map.json
        self.special_tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name, legacy.get(name)))
            if text is not None:
                self.special_tokens[name] = text
        extra = config.get("additional_special_tokens", legacy.get("additional_special_tokens"))
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self._token_id(self.bos_token, "bos_token", config_file)
        eos_id = self._token_id(self.eos_token, "eos_token", config_file)
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self.chat_templates: ChatTemplates | None = load_chat_templates(folder, config)
        self._log_bos_mismatch(config)

    @property
    def chat_template(self) -> str | None:
        """The default chat template's text (``None`` when the folder has none)."""
        if self.chat_templates is None:
            return None
        try:
            return self.chat_templates.select().source
        except InvalidRequestError:
            return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def raw_tokenizer(self):  # a ``tokenizers.Tokenizer``
        """The ``tokenizers`` library's tokenizer (a grammar engine reads its vocabulary)."""
        return self._tok

    def _template_sources(self) -> str:
        if str(self.folder).endswith(".gguf"):
            return f"no tokenizer.chat_template in {self.folder}"
        return (
            "none of chat_template.jinja, chat_template.json or a chat_template in tokenizer_config.json "
            f"in {self.folder}"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text of ``messages`` rendered by the model's (default or named) chat template."""
        messages = _checked_messages(messages)
        if self.chat_templates is None:
            raise InvalidRequestError(
                f"this model has no chat template ({self._template_sources()}); use /v1/completions"
            )
        return self.chat_templates.render(
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_name=chat_template,
            template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def handles_tools(self, chat_template: str | None = None) -> bool:
        """Does the model's chat template render ``tools`` itself?"""
        return self.chat_templates is not None and self.chat_templates.handles_tools(chat_template)

    # ---- load-time checks ----------------------------------------------
    def _token_id(self, token: str | None, name: str, config_file: Path) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerFilesError(f"{config_file}: {name} {token!r} is not in tokenizer.json's vocabulary")
        return token_id

    def _check_added_tokens(self, config: Mapping[str, Any], config_file: Path) -> None:
        """``added_tokens_decoder`` ids must be what ``tokenizer.json`` gives those tokens
        (otherwise ids would not match the model's embeddings)."""
        decoder = config.get("added_tokens_decoder")
        if not isinstance(decoder, Mapping):
            return
        for key, entry in decoder.items():
            text = _token_text(entry)
            if text is None or not str(key).isdigit():
                raise TokenizerFilesError(f"{config_file}: added_tokens_decoder entry {key!r} is malformed")
            actual = self._tok.token_to_id(text)
            if actual != int(key):
                where = "is missing from" if actual is None else f"has id {actual} in"
                raise TokenizerFilesError(f"{config_file}: added token {text!r} (id {key}) {where} tokenizer.json")

    def _log_bos_mismatch(self, config: Mapping[str, Any]) -> None:
        wanted = config.get("add_bos_token")
        if not isinstance(wanted, bool) or self.bos_token_id is None:
            return
        adds = self._tok.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id]
        if wanted != adds:
            log.warning(
                "%s: tokenizer_config.json sets add_bos_token=%s but tokenizer.json %s BOS; following "
                "tokenizer.json, as transformers >= 5 does",
                self.folder,
                wanted,
                "adds" if adds else "does not add",
            )


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} (an AddedToken)
        content = token.get("content")
        return content if isinstance(content, str) else None
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
