"""Typed errors of the scheduler (all ``strata_jax.api.StrataError``)."""

from __future__ import annotations

from strata_jax.api import StrataError


class UnknownRequestError(StrataError, KeyError):
    """No live request has this id."""


class SchedulerStateError(StrataError, RuntimeError):
    """The engine reported something that contradicts the scheduler's state (a bug)."""
