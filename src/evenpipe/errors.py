"""One error policy: user-input errors are ``EvenpipeError`` (a ``ValueError``) whose message names the bad value
and what is allowed. The CLI turns them into one line on stderr and exit code 2."""

from __future__ import annotations

import enum
from typing import TypeVar

_E = TypeVar("_E", bound=enum.Enum)

__all__ = ["EvenpipeError", "ScheduleFormatError", "ScheduleValidationError", "ConfigError", "choice_error",
           "parse_choice"]


class EvenpipeError(ValueError):
    """Bad input from the user: the message says what was wrong and what is allowed."""


class ScheduleFormatError(EvenpipeError):
    """A schedule (text, JSON, CSV or hand-built) is malformed."""


class ScheduleValidationError(EvenpipeError):
    """A schedule breaks a rule (dependency, matching, deadlock); the message carries a rank-by-step grid."""

    def __init__(self, rule: str, message: str, grid: str = "") -> None:
        self.rule = rule
        self.grid = grid
        super().__init__(f"[{rule}] {message}" + (f"\n{grid}" if grid else ""))


class ConfigError(EvenpipeError):
    """A configuration value is out of range or inconsistent with another."""


def choice_error(what: str, value: object, allowed: "list[str] | tuple[str, ...]") -> ConfigError:
    """The standard 'unknown X' error listing the valid names."""
    return ConfigError(f"unknown {what} {value!r}; choose one of: {', '.join(allowed)}")


def parse_choice(enum_type: type[_E], value: "str | _E", what: str, *, normalize: bool = False) -> _E:
    """The member of ``enum_type`` whose value is ``value`` (case-insensitive; with ``normalize``, surrounding
    space is ignored and ``_`` stands for ``-``); a member passes through. Anything else is the standard
    :func:`choice_error` listing the valid names. Strings are parsed once, at the edge, through this."""
    if isinstance(value, enum_type):
        return value
    wanted = str(value).lower()
    if normalize:
        wanted = wanted.strip().replace("_", "-")
    for member in enum_type:
        if member.value == wanted:
            return member
    raise choice_error(what, value, [str(m.value) for m in enum_type])
