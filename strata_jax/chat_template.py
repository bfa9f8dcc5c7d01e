"""Chat templates as Hugging Face ships them: found, compiled at load, rendered per request.

Where a folder keeps its templates, in the order they are looked for (the first
source that has any wins, as in transformers; the others are logged and ignored):

1. ``chat_template.jinja`` (the default template) plus ``additional_chat_templates/NAME.jinja``
   (named ones): what transformers >= 4.43 saves;
2. ``chat_template.json``: ``{"chat_template": "..."}`` (the processors' legacy file) or a
   list / dict of named templates;
3. ``tokenizer_config.json``'s ``chat_template``: one string, or a list of
   ``{"name": ..., "template": ...}``.

A template is chosen by name (``"default"`` unless the request names another); a folder
with several templates and none named ``default`` needs the request to choose.

Rendering follows transformers' ``apply_chat_template``: a sandboxed Jinja environment
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag), the
``tojson``/``raise_exception``/``strftime_now`` helpers, the special tokens as variables,
``add_generation_prompt``, and ``continue_final_message`` (render the conversation, then
cut it right after the final message's text so the model continues that message).

Errors: a template that does not compile raises ``TokenizerFilesError`` naming the file at
load; anything wrong at render time (a ``raise_exception`` in the template, bad kwargs,
the final message not found) raises ``InvalidRequestError`` (HTTP 400).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from strata_jax.api import InvalidRequestError
from strata_jax.models.config import ModelConfigError

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_TEMPLATE_JSON = "chat_template.json"
DEFAULT_NAME = "default"
# Names the renderer sets itself; ``chat_template_kwargs`` may not override them.
RESERVED_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)
# Marks the end of the final message when continuing it (trailing space: tells whether the template trims).
_CONTINUE_TAG = "STRATA_CONTINUE_FINAL_MESSAGE "


class TokenizerFilesError(ModelConfigError):
    """A tokenizer file of the model folder is broken; the message names the file."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore attributes (no reaching into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    source: str  # the Jinja text
    origin: str  # the file it came from
    compiled: jinja2.Template = field(repr=False, compare=False)


@dataclass(frozen=True)
class ChatTemplates:
    """A folder's chat templates by name."""

    templates: Mapping[str, ChatTemplate]

    @property
    def names(self) -> list[str]:
        return sorted(self.templates)

    def select(self, name: str | None = None) -> ChatTemplate:
        """The template called ``name``; ``None``: the default one (or the only one)."""
        if name is not None:
            if name not in self.templates:
                raise InvalidRequestError(
                    f"chat_template must name one of this model's chat templates {self.names}; got {name[:80]!r} "
                    "(templates sent with the request are not accepted)"
                )
            return self.templates[name]
        if DEFAULT_NAME in self.templates:
            return self.templates[DEFAULT_NAME]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise InvalidRequestError(
            f"this model has several chat templates {self.names} and none is named {DEFAULT_NAME!r}: "
            "choose one with the request field chat_template"
        )

    def handles_tools(self, template_name: str | None = None) -> bool:
        """Does the template render a ``tools`` list (and so, by convention, tool calls and results)?"""
        template = self.select(template_name)
        return "tools" in jinja2.meta.find_undeclared_variables(template.compiled.environment.parse(template.source))

    def render(
        self,
        messages: list[dict],
        *,
        special_tokens: Mapping[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_name: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (``InvalidRequestError`` on anything the caller got wrong).

        ``tools``: function definitions as HF templates take them (``{"type": "function",
        "function": {...}}``), for templates that render tools (``handles_tools``)."""
        template = self.select(template_name)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        kwargs = dict(template_kwargs or {})
        clash = sorted(RESERVED_KWARGS & set(kwargs))
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {clash}: use the request fields of those names"
            )
        chat = [dict(m) for m in messages]
        final_text = ""
        if continue_final_message:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise InvalidRequestError("continue_final_message needs a final message with text content to continue")
            final_text = chat[-1]["content"]
            chat[-1]["content"] = final_text + _CONTINUE_TAG
        variables = {**special_tokens, **kwargs}  # kwargs may override a special token, as in transformers
        try:
            text = template.compiled.render(
                **variables, messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template {template.name!r} ({template.origin}): {exc}") from None
        except Exception as exc:  # a template is code: its failures are the request's
            raise InvalidRequestError(
                f"chat template {template.name!r} ({template.origin}) failed: {type(exc).__name__}: {exc}"
            ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, final_text)
        return text


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    """Drop what the template put after the final message (end-of-turn tokens), keeping its text."""
    mark = _CONTINUE_TAG.strip()
    if mark not in rendered or final_text.strip() not in rendered:
        raise InvalidRequestError(
            "continue_final_message is set but the final message does not appear in the rendered chat "
            "(this model's chat template drops or rewrites it)"
        )
    at = rendered.rindex(mark)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]  # the template kept the text as is
    return rendered[:at].rstrip()  # the template trimmed the message: trim what precedes the mark too


def _compile(env: jinja2.Environment, name: str, source: object, origin: Path) -> ChatTemplate:
    if not isinstance(source, str) or not source.strip():
        raise TokenizerFilesError(f"{origin}: chat template {name!r} must be a non-empty string")
    try:
        compiled = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerFilesError(
            f"{origin}: chat template {name!r} is not valid Jinja (line {exc.lineno}: {exc.message})"
        ) from None
    return ChatTemplate(name, source, str(origin), compiled)


def _named_entries(value: object, origin: Path) -> dict[str, object]:
    """``"..."`` -> {default: ...}; ``[{"name", "template"}, ...]`` or ``{name: template}`` -> by name."""
    if isinstance(value, str):
        return {DEFAULT_NAME: value}
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list):
        out: dict[str, object] = {}
        for i, entry in enumerate(value):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or "template" not in entry:
                raise TokenizerFilesError(
                    f"{origin}: chat_template[{i}] must be an object with a string 'name' and a 'template'"
                )
            if entry["name"] in out:
                raise TokenizerFilesError(f"{origin}: chat template name {entry['name']!r} appears twice")
            out[entry["name"]] = entry["template"]
        return out
    raise TokenizerFilesError(f"{origin}: chat_template must be a string or a list of {{name, template}} objects")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerFilesError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise TokenizerFilesError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path`` (``TokenizerFilesError`` naming it otherwise)."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise TokenizerFilesError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(value, dict):
        raise TokenizerFilesError(f"{path}: must hold a JSON object")
    return value


def load_chat_templates(folder: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplates | None:
    """The folder's chat templates, compiled (``None`` when it has none)."""
    env = _environment()
    sources: list[tuple[str, dict[str, tuple[object, Path]]]] = []

    files: dict[str, tuple[object, Path]] = {}
    if (folder / TEMPLATE_FILE).is_file():
        files[DEFAULT_NAME] = (_read_text(folder / TEMPLATE_FILE), folder / TEMPLATE_FILE)
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = (_read_text(path), path)
    sources.append((f"{TEMPLATE_FILE} / {TEMPLATE_DIR}/", files))

    legacy: dict[str, tuple[object, Path]] = {}
    if (folder / LEGACY_TEMPLATE_JSON).is_file():
        path = folder / LEGACY_TEMPLATE_JSON
        data = read_json_object(path)
        if "chat_template" not in data:
            raise TokenizerFilesError(f"{path}: has no 'chat_template' key")
        legacy = {k: (v, path) for k, v in _named_entries(data["chat_template"], path).items()}
    sources.append((LEGACY_TEMPLATE_JSON, legacy))

    in_config: dict[str, tuple[object, Path]] = {}
    if tokenizer_config.get("chat_template") is not None:
        path = folder / "tokenizer_config.json"
        in_config = {k: (v, path) for k, v in _named_entries(tokenizer_config["chat_template"], path).items()}
    sources.append(("tokenizer_config.json", in_config))

    found = [(label, entries) for label, entries in sources if entries]
    if not found:
        return None
    label, entries = found[0]
    for other, _ in found[1:]:
        log.info("%s: chat templates from %s take precedence over those in %s", folder, label, other)
    return ChatTemplates({name: _compile(env, name, src, origin) for name, (src, origin) in entries.items()})
