"""``strata-jax serve``: flags and entry point (wired in by ``serving.cli``).

Server flags map to ``ServerConfig``; engine flags are generated from the fields
of ``strata_jax.engine.EngineConfig`` (``--page-size``, ``--policy``, ...), so
new cache/scheduler knobs appear here without edits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import typing
from typing import Any

from serving.config import ROLES, ServerConfig
from serving.server import StrataServer
from strata_jax.engine.handoff import HandoffPolicy

log = logging.getLogger("strata_jax.serve")
# HandoffPolicy fields serve sets
HANDOFF_FLAGS = ("base_s", "prefill_factor", "stall_s", "max_wait_s", "peer_poll_s", "local_tokens")

_ENGINE_FLAG_PREFIX = "engine_"
_NEST = "__"  # argparse dest separator for nested fields (scheduler.policy -> engine_scheduler__policy)


def _engine_config_class() -> type | None:
    try:
        from strata_jax.engine import EngineConfig
    except ImportError:
        return None
    return EngineConfig if dataclasses.is_dataclass(EngineConfig) else None


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        try:
            return f.default_factory()
        except Exception:  # noqa: BLE001
            return None
    return None


def engine_flag_fields(config_cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    """``(path, field, default)`` for every scalar field of ``config_cls``, one level of nesting deep.

    A field holding a dataclass (e.g. ``scheduler: SchedulerConfig``) contributes its own
    fields as ``scheduler.policy`` etc.; the flag is named after the inner field
    (``--policy``) unless that name is taken.
    """
    out: list[tuple[str, dataclasses.Field, Any]] = []
    for f in dataclasses.fields(config_cls):
        if not f.init or f.name == "model":
            continue
        default = _field_default(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            for inner in dataclasses.fields(default):
                if inner.init:
                    out.append((f"{f.name}.{inner.name}", inner, getattr(default, inner.name)))
        else:
            out.append((f.name, f, default))
    return out


def build_engine_config(config_cls: type, model: str, overrides: dict[str, Any]) -> Any:
    """``config_cls(model=model, ...)`` with ``overrides`` keyed by field path (``a`` or ``a.b``)."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in overrides.items():
        outer, _, inner = path.partition(".")
        if inner:
            nested.setdefault(outer, {})[inner] = value
        else:
            top[outer] = value
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for outer, values in nested.items():
        base = top.get(outer) or _field_default(fields[outer])
        top[outer] = dataclasses.replace(base, **values)
    return config_cls(model=model, **top)


def _scalar_type(field: dataclasses.Field, default: Any) -> type | None:
    if isinstance(default, bool):
        return bool
    if isinstance(default, (int, float, str)):
        return type(default)
    hint = field.type if not isinstance(field.type, str) else None
    if hint is None:  # postponed annotations: read the string
        text = str(field.type).replace(" ", "")
        for name, typ in (("int", int), ("float", float), ("str", str), ("bool", bool)):
            if text in (name, f"{name}|None", f"None|{name}", f"Optional[{name}]"):
                return typ
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float, str, bool) else None


def field_docs(cls: type) -> dict[str, str]:
    """``{field: description}`` from a docstring written as ``name: text`` (``a / b: text`` for several)."""
    import inspect
    import re

    docs: dict[str, str] = {}
    current: list[str] = []
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        m = re.match(r"^([a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s+(.*)$", line)
        if m:
            current = [n.strip() for n in m.group(1).split("/")]
            for name in current:
                docs[name] = m.group(2).strip()
        elif current and line.startswith((" ", "\t")) and line.strip():
            for name in current:
                docs[name] += " " + line.strip()
        else:
            current = []
    return docs


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``strata-jax serve``: the server's, then one per ``EngineConfig`` field."""
    _add_server_flags(parser)
    _add_engine_flags(parser)


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """The ``ServerConfig`` flags."""
    d = ServerConfig()
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (built-in test model), a Hugging Face model folder or a .gguf file (needs the gguf extra)",
    )
    srv.add_argument("--served-model-name", default=None, help="model name clients must send (default: the engine's)")
    srv.add_argument("--host", default=d.host, help="address to bind; anything off loopback needs --api-key")
    srv.add_argument("--port", type=int, default=d.port, help="HTTP (OpenAI-compatible) port; 0 picks a free one")
    srv.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port; 0 picks a free one")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("STRATA_API_KEY"),
        help="require 'Authorization: Bearer KEY' on HTTP and gRPC (default: $STRATA_API_KEY)",
    )
    srv.add_argument(
        "--admin-api-key",
        default=os.environ.get("STRATA_ADMIN_API_KEY"),
        help="the admin routes (/admin/*, POST /flush_cache; gRPC GetCacheStats, FlushCache, StartProfile, "
        "StopProfile) take this key and no longer the --api-key, which keeps the other routes "
        "(default: $STRATA_ADMIN_API_KEY; unset: the admin routes take the --api-key)",
    )
    srv.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest HTTP body / gRPC message")
    srv.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="seconds an HTTP request body may take to arrive whole; a slower sender gets 408 and is disconnected",
    )
    srv.add_argument(
        "--default-chat-max-tokens",
        type=int,
        default=d.default_chat_max_tokens,
        help="max_tokens for chat requests that do not set it",
    )
    srv.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default=d.generation_config,
        help="auto: sampling fields a request leaves unset take the model's generation_config.json values "
        "(temperature, top_p, top_k, repetition_penalty, max_new_tokens for chat); none: ignore them and use "
        "the server defaults (its EOS ids still stop generation)",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "llama3_json"),
        default=d.tool_call_parser,
        help="how chat replies are parsed into tool calls (and tools described to a chat template that does not "
        'render them): hermes, <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, Hermes); llama3_json, '
        '{"name": ..., "parameters": ...} (Llama 3); auto picks from the chat template (default)',
    )
    srv.add_argument("--grace-s", type=float, default=d.grace_s, help="SIGTERM: seconds to finish in-flight work")
    srv.add_argument("--profile-dir", default=None, help="where jax.profiler traces go (StartProfile / admin route)")
    srv.add_argument(
        "--profile-on-start",
        action="store_true",
        help="trace from warm-up until shutdown into --profile-dir",
    )
    srv.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (vLLM's flag): requests select one by its name in `model`; adapters load with "
        "--lora-modules or POST /v1/load_lora_adapter.  Sets --max-loras to 1 when not given",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT adapter folders to load at start, as name=path or vLLM's JSON "
        '{"name": ..., "path": ...}; implies --enable-lora, and --max-loras defaults to their count',
    )
    srv.add_argument(
        "--role",
        default=d.role,
        choices=ROLES,
        help="this replica's part in prefill/decode disaggregation behind sglang-router --pd-disaggregation: "
        "a request carrying a bootstrap_room runs its prompt and one token (prefill; its pages go to the shared "
        "L3) or waits for the prompt's pages in L3 before decoding (decode); needs --tiers L1+L2+L3 on a shared "
        "--storage-backend. Requests without a room are served as usual (docs/serving.md)",
    )
    handoff_docs = field_docs(HandoffPolicy)
    for name in HANDOFF_FLAGS:
        srv.add_argument(
            f"--handoff-{name.replace('_', '-')}",
            type=type(getattr(d.handoff, name)),
            default=getattr(d.handoff, name),
            help=f"decode role: {handoff_docs[name]} (default: %(default)s)",
        )
    srv.add_argument("--no-http", action="store_true", help="do not start the HTTP server")
    srv.add_argument("--no-grpc", action="store_true", help="do not start the gRPC server")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per scalar ``EngineConfig`` field (its own name, else its dotted path when taken)."""
    config_cls = _engine_config_class()
    if config_cls is None:
        return
    eng = parser.add_argument_group("engine (strata_jax.engine.EngineConfig fields)")
    taken = {opt for action in parser._actions for opt in action.option_strings}  # noqa: SLF001 - no public list
    docs = field_docs(config_cls)
    for path, f, default in engine_flag_fields(config_cls):
        typ = _scalar_type(f, default)
        if typ is None:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if flag in taken:
            flag = f"--{path.replace('.', '-').replace('_', '-')}"
        if flag in taken:
            continue
        taken.add(flag)
        eng.add_argument(
            flag,
            dest=_ENGINE_FLAG_PREFIX + path.replace(".", _NEST),
            type=_bool if typ is bool else typ,
            default=None,
            metavar=typ.__name__.upper(),
            help=f"{docs.get(f.name, 'EngineConfig.' + path).replace('%', '%%')} (default: {default!r})",
        )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields set on the command line."""
    return {
        k[len(_ENGINE_FLAG_PREFIX) :].replace(_NEST, "."): v
        for k, v in vars(args).items()
        if k.startswith(_ENGINE_FLAG_PREFIX) and v is not None
    }


def lora_overrides(
    enable: bool, modules: list[str] | None, max_loras: int | None, served_name: str | None = None
) -> dict[str, Any]:
    """EngineConfig fields of ``--enable-lora`` / ``--lora-modules`` (``name=path`` or vLLM's
    JSON object); ``max_loras`` given on the command line wins, else 1 or the modules' count.
    Refused: an adapter named like ``--served-model-name`` (the base would shadow it), and
    LoRA asked for with ``--max-loras 0``."""
    pairs = []
    for item in modules or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f'--lora-modules {item!r}: a JSON module needs "name" and "path" ({exc})') from exc
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
        if served_name is not None and name == served_name:
            raise ValueError(f"--lora-modules {item!r}: {name!r} is --served-model-name; give the adapter another")
        pairs.append((str(name), str(path)))
    if not enable and not pairs:
        return {}
    if max_loras == 0:
        raise ValueError("--enable-lora / --lora-modules with --max-loras 0: LoRA needs at least one slot")
    out: dict[str, Any] = {"lora_modules": tuple(pairs)}
    if max_loras is None:
        out["max_loras"] = max(1, len(pairs))
    return out


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key or None,
        admin_api_key=args.admin_api_key or None,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        default_chat_max_tokens=args.default_chat_max_tokens,
        generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser,
        grace_s=args.grace_s,
        profile_dir=args.profile_dir,
        profile_on_start=args.profile_on_start,
        enable_http=not args.no_http,
        enable_grpc=not args.no_grpc,
        role=args.role,
        handoff=HandoffPolicy(**{name: getattr(args, f"handoff_{name}") for name in HANDOFF_FLAGS}),
    )


def check_role(role: str, engine_config: Any) -> None:
    """A prefill or decode replica hands prompts over through L3: it needs one, and a prefill
    replica must write each prompt's pages through to it (``write_through``)."""
    if role == "both":
        return
    if "L3" not in engine_config.tiers:
        raise ValueError(f"--role {role} hands prompts over through the shared L3: add --tiers L1+L2+L3")
    if role == "prefill" and engine_config.write_policy != "write_through":
        raise ValueError(
            f"--role prefill writes every prompt's pages to L3 as its prefill ends: --write-policy write_through "
            f"(got {engine_config.write_policy})"
        )


def role_engine_config(role: str, engine_config: Any) -> Any:
    """The engine configuration a role runs: a prefill replica publishes each prefill chunk's
    pages as it goes (``publish_prefill_chunks``), so they land in L3 before its prefill ends."""
    if role == "prefill" and not engine_config.publish_prefill_chunks:
        return dataclasses.replace(engine_config, publish_prefill_chunks=True)
    return engine_config


def run_serve(args: argparse.Namespace) -> int:
    """Start both servers; returns 0 after a clean SIGTERM/SIGINT shutdown."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = server_config(args)
    except ValueError as exc:
        print(f"strata-jax serve: {exc}", file=sys.stderr)
        return 2
    overrides = engine_overrides(args)
    try:
        overrides |= lora_overrides(
            args.enable_lora, args.lora_modules, overrides.get("max_loras"), args.served_model_name
        )
    except ValueError as exc:
        print(f"strata-jax serve: {exc}", file=sys.stderr)
        return 2
    try:
        from strata_jax.engine import Engine, EngineConfig
    except ImportError as exc:
        print(f"strata-jax serve: the engine is not available: {exc}", file=sys.stderr)
        return 2
    try:  # bad engine flags fail here, before any port is bound
        engine_config = build_engine_config(EngineConfig, args.model, overrides)
    except (ValueError, TypeError) as exc:
        print(f"strata-jax serve: bad engine configuration: {exc}", file=sys.stderr)
        return 2
    try:
        check_role(config.role, engine_config)
        engine_config = role_engine_config(config.role, engine_config)
    except ValueError as exc:
        print(f"strata-jax serve: {exc}", file=sys.stderr)
        return 2
    from strata_jax.runtime.warmup_progress import WarmupProgress

    progress = WarmupProgress(log_progress=True)  # logged, and shown on /health (503) until ready
    server = StrataServer(config, lambda: Engine(engine_config, on_progress=progress))
    server.frontend.warmup_progress = progress
    return asyncio.run(server.serve(handle_signals=True))
