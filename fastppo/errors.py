"""The one exception type for bad settings or input, so the command line can tell a user's mistake (one line,
exit 2) from a bug (a traceback, exit 1)."""
from __future__ import annotations


class SettingsError(ValueError):
    """A setting, argument or input that cannot work, with a message naming it and saying what to do.
    A ValueError, so callers that catch ValueError (as TRL's users do) still catch it."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
