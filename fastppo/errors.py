"""The exception types for bad settings or input, so the command line can tell a user's mistake (one line,
exit 2) from a bug or a failure (a traceback, exit 1); and the one failure it also tells in one line (exit 1):
a collective that timed out (``CollectiveTimeout``).

Each settings error is a ``SettingsError`` and also the built-in type a caller would catch for that kind of
mistake (a ``ValueError`` always, plus ``TypeError`` or ``FileNotFoundError``/``OSError``), so code written
against TRL's exceptions still catches them."""
from __future__ import annotations

import contextlib


class SettingsError(ValueError):
    """A setting, argument or input that cannot work, with a message naming it and saying what to do."""


class SettingsTypeError(SettingsError, TypeError):
    """An argument of the wrong type."""


class MissingPathError(SettingsError, FileNotFoundError):
    """A path the user named that does not exist (a model, dataset or checkpoint)."""


class LoadError(SettingsError, OSError):
    """A model, tokenizer or checkpoint the user named that cannot be read."""


class CollectiveTimeout(RuntimeError):
    """A collective that did not complete within the process group's timeout (``--ddp_timeout``): another
    process is frozen, dead or far behind. Raised from the backend's own error by ``fastppo.dist``'s wrappers of
    the collectives, the one place that reads a backend's message; ``collective`` names the call and ``detail``
    is the first line of the backend's message. A ``RuntimeError``, as the backend's error is."""

    def __init__(self, collective: str, detail: str):
        self.collective, self.detail = collective, detail
        super().__init__(f"{collective} did not complete within the process group's timeout (--ddp_timeout): "
                         "another process is frozen, dead or far behind; find it (its log, `py-spy dump --pid`), or "
                         f"raise --ddp_timeout if it is only slow ({detail})")

    def __reduce__(self):
        return type(self), (self.collective, self.detail)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


@contextlib.contextmanager
def settings_errors(what: str):
    """Errors raised while building the user's settings (transformers' own ``TrainingArguments`` checks, a
    dataclass's conversions) are the user's: re-raised as ``SettingsError`` with the same message."""
    try:
        yield
    except SettingsError:
        raise
    except (ValueError, TypeError) as e:
        raise SettingsError(f"{what}: {e}") from e
