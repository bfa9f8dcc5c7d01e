"""API keys of both faces: which key a route takes, and why a call is refused.

Two scopes.  Inference routes (generation, models, metrics, a router's worker routes)
take ``--api-key``.  Admin routes (``/admin/*``, ``POST /flush_cache``; gRPC
``GetCacheStats``, ``FlushCache``, ``StartProfile``, ``StopProfile``) take
``--admin-api-key`` when one is set, else ``--api-key`` as before.  The keys do not
stand in for each other: an admin key sent to an inference route, or the inference key
sent to an admin route, is a known key of the wrong scope ("forbidden": HTTP 403, gRPC
``PERMISSION_DENIED``); anything else is "unauthenticated" (401, ``UNAUTHENTICATED``).
Why separate: the key handed to every client must not flush everyone's cache or start a
profiler, and an operator's admin key in a script should not be a way to generate.  An
operator who wants one key for both sets the two flags to the same value.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from serving.config import ServerConfig


class Scope(enum.Enum):
    INFERENCE = "inference"
    ADMIN = "admin"


@dataclass(frozen=True)
class Refusal:
    """Why a call was refused: ``forbidden`` (a valid key of the other scope) or not."""

    forbidden: bool
    message: str


def _matches(sent: bytes, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(sent, f"Bearer {key}".encode())


def required_key(config: ServerConfig, scope: Scope) -> str | None:
    """The key ``scope`` takes (``None``: open)."""
    if scope is Scope.ADMIN and config.admin_api_key is not None:
        return config.admin_api_key
    return config.api_key


def check(config: ServerConfig, scope: Scope, authorization: str | bytes | None) -> Refusal | None:
    """``None`` when ``authorization`` (the raw header / metadata value) grants ``scope``."""
    key = required_key(config, scope)
    if key is None:
        return None
    sent = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
    if _matches(sent, key):
        return None
    if scope is Scope.ADMIN and config.admin_api_key is not None:
        if _matches(sent, config.api_key):
            return Refusal(
                True, "this admin route needs the admin API key (--admin-api-key); the API key does not grant it"
            )
        return Refusal(False, "missing or wrong admin API key")
    if _matches(sent, config.admin_api_key):
        return Refusal(True, "the admin API key grants only the admin routes; send the API key (--api-key)")
    return Refusal(False, "missing or wrong API key")


def any_key(config: ServerConfig) -> bool:
    """Whether some route needs a key at all."""
    return config.api_key is not None or config.admin_api_key is not None
