"""fastppo's Python logging, shown as TRL's is: transformers gives its library logger a handler to stderr at WARNING
(``transformers.utils.logging``), so a TRL user sees its warnings without configuring logging; fastppo's
``fastppo`` logger gets one too (``install``). Unlike transformers' logger it still propagates, so a user's own
logging configuration (``logging.basicConfig``, pytest's ``caplog``) receives fastppo's records; the library's
handler then stands aside, and each warning is printed once, not twice.

Each warning is shown once per trainer: a module's logger (``library_logger``) drops a message it already logged
since the last trainer was built (``new_run``), as transformers' ``logger.warning_once`` does, whichever handler
prints it. A record the trainer's console already
printed (``CONSOLE_SHOWN`` in its ``extra``) goes to the user's logging only.

transformers' own logging is set to ERROR while fastppo runs; the level the user left is kept
(``quieting_transformers``), since TrainingArguments decides its default ``disable_tqdm`` from it (``user_verbosity``).
"""
from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

LIBRARY = "fastppo"
# a record's ``extra`` key: the trainer's console printed the same line, so the library's handler skips it
CONSOLE_SHOWN = "fastppo_console_shown"


class ShownOnce(logging.Filter):
    """Drops a record whose level and message its logger already let through (a warning repeated every iteration
    is printed once)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[int, str]] = set()
        FILTERS.append(self)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


FILTERS: list[ShownOnce] = []  # every module logger's, for new_run


def new_run() -> None:
    """A new trainer warns afresh (a second run in one process is told what the first was)."""
    for shown in FILTERS:
        shown.seen.clear()


def library_logger(name: str) -> logging.Logger:
    """The logger of a fastppo module (``name``: its ``__name__``), each message of which is shown once."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, ShownOnce) for f in logger.filters):
        logger.addFilter(ShownOnce())
    return logger


class LibraryHandler(logging.StreamHandler):
    """stderr at WARNING, as transformers' library handler, while no other handler would print the record: a
    handler on a logger above (the root's, from ``logging.basicConfig``; another on ``fastppo``) means the user
    configured logging, and the record reaches it by propagation."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, CONSOLE_SHOWN, False) or self.user_configured():
            return False
        return super().filter(record)

    def user_configured(self) -> bool:
        logger = logging.getLogger(LIBRARY)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # the stderr of now (pytest's capsys, a redirect), as the last-resort handler does
        with tqdm.external_write_mode(file=self.stream):  # the progress bar cleared around it, as tqdm.write does
            super().emit(record)


def install() -> None:
    """The ``fastppo`` logger's handler (once per process): fastppo's warnings shown by default."""
    logger = logging.getLogger(LIBRARY)
    if not any(isinstance(h, LibraryHandler) for h in logger.handlers):
        logger.addHandler(LibraryHandler())


# transformers' verbosity as the user left it, before a trainer set it to ERROR (``quieting_transformers``); empty
# while no trainer has
_USER_VERBOSITY: list[int] = []


def quieting_transformers(current: int) -> None:
    """A trainer sets transformers' logging to ERROR while fastppo runs; ``current`` (its level until then) is the
    user's, unless it is still the ERROR an earlier trainer set."""
    if not (_USER_VERBOSITY and current == logging.ERROR):
        _USER_VERBOSITY[:] = [current]


def user_verbosity(current: int) -> int:
    """transformers' verbosity as the user set it, given the ``current`` one: the level before a trainer quieted it,
    while it stays quieted (TrainingArguments decides its default disable_tqdm from it: a second config in the
    process would otherwise read fastppo's ERROR and lose its progress bar)."""
    return _USER_VERBOSITY[0] if _USER_VERBOSITY and current == logging.ERROR else current
