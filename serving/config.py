"""``ServerConfig``: everything the serving faces need to know, fixed at start-up."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from strata_jax.engine.handoff import HandoffPolicy

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
GENERATION_CONFIG_CHOICES = ("auto", "none")
ROLES = ("both", "prefill", "decode")  # prefill/decode disaggregation (serving/disaggregation.py)


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the gRPC and HTTP servers (not of the engine).

    ``port``/``grpc_port`` 0 pick a free port (tests).  A server bound off loopback
    must have an ``api_key``; clients then send ``Authorization: Bearer <key>``
    (HTTP and gRPC metadata alike).  With an ``admin_api_key`` the admin routes
    (``/admin/*``, ``POST /flush_cache``, gRPC ``GetCacheStats``/``FlushCache``/
    ``StartProfile``/``StopProfile``) take that key and only that key; without one
    they take ``api_key`` like every other route.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    admin_api_key: str | None = None  # the admin routes' own key (default: they take api_key)
    served_model_name: str | None = None  # default: the engine's model_name
    max_body_bytes: int = 8 << 20  # HTTP bodies and gRPC messages
    body_timeout_s: float = 60.0  # an HTTP body must arrive whole within this (slow senders get 408)
    max_batch_prompts: int = 64  # prompts in one /v1/completions request
    default_chat_max_tokens: int = 256  # chat requests without max_tokens
    generation_config: str = "auto"  # "auto": the model's generation_config.json sampling defaults; "none": ignore them
    tool_call_parser: str = "auto"  # serving/tool_calls.py: auto | hermes | llama3_json
    grace_s: float = 10.0  # SIGTERM: time to finish in-flight work
    profile_dir: str | None = None  # default dir for StartProfile / admin route
    profile_on_start: bool = False  # trace from warm-up to shutdown into profile_dir
    enable_http: bool = True
    enable_grpc: bool = True
    role: str = "both"  # prefill | decode | both: this replica's part in a disaggregated request
    handoff: HandoffPolicy = field(default_factory=HandoffPolicy)  # how long a decode replica waits for L3

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_batch_prompts < 1 or self.default_chat_max_tokens < 1:
            raise ValueError("max_batch_prompts and default_chat_max_tokens must be positive")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, got {self.generation_config!r}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.profile_on_start and not self.profile_dir:
            raise ValueError("profile_on_start needs a profile_dir (--profile-dir)")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not is_loopback(self.host) and self.api_key is None:
            raise ValueError(f"binding to {self.host!r} (off loopback) needs an api_key (--api-key)")
