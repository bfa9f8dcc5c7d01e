"""Free text (a CLI flag, an env variable) to one of a setting's ``Literal`` values."""

from __future__ import annotations

from typing import TypeVar

_Choice = TypeVar("_Choice", bound=str)


def choose(value: str, choices: tuple[_Choice, ...], setting: str) -> _Choice:
    """``value`` as the member of ``choices`` it names; ``ValueError`` saying what is allowed otherwise."""
    for choice in choices:
        if choice == value:
            return choice
    raise ValueError(f"{setting} must be one of {', '.join(choices)}, got {value!r}")
