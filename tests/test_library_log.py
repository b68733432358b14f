"""fastppo's warnings are seen, as TRL's are (issue 60 item 10): without a logging configuration on stderr, with
the user's through it alone (never printed twice), each once per trainer; and the completion tables print
bracketed text as it is (rich would read ``[none]`` as markup and drop it)."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent

# "All reward functions returned None" is logged by fastppo.reward_scores' logger; the same logger, repeated
WARN = """
import logging, sys
{setup}
import fastppo.reward_scores
log = logging.getLogger("fastppo.reward_scores")
log.warning("All reward functions returned None for the following kwargs: {{}}")
log.warning("All reward functions returned None for the following kwargs: {{}}")
log.warning("another warning")
log.info("an info line")
"""


def run(setup: str = "") -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", WARN.format(setup=setup)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_warnings_are_shown_on_stderr_once_without_a_logging_configuration():
    err = run()
    assert err.count("All reward functions returned None") == 1
    assert err.count("another warning") == 1
    assert "an info line" not in err  # WARNING and above, as transformers' library handler


def test_a_users_logging_configuration_prints_each_warning_once():
    err = run('logging.basicConfig(format="ROOT %(name)s: %(message)s")')
    assert err.count("All reward functions returned None") == 1
    assert "ROOT fastppo.reward_scores: All reward functions returned None" in err
    assert err.count("another warning") == 1


def test_a_new_trainer_is_warned_again_and_console_lines_are_not_printed_twice():
    from fastppo import library_log
    from fastppo.library_log import CONSOLE_SHOWN, LibraryHandler, library_logger

    handler = next(h for h in logging.getLogger("fastppo").handlers if isinstance(h, LibraryHandler))
    log = library_logger("fastppo.test_library_log")
    shown = []
    log.addHandler(recorder := logging.Handler())
    recorder.emit = shown.append
    try:
        log.warning("once per run")
        log.warning("once per run")
        library_log.new_run()
        log.warning("once per run")
        assert [r.getMessage() for r in shown] == ["once per run", "once per run"]
        # a note the trainer's console printed reaches the user's logging, not the library's stderr handler
        record = log.makeRecord(log.name, logging.WARNING, __file__, 0, "noted", (), None,
                                extra={CONSOLE_SHOWN: True})
        assert not handler.filter(record)
    finally:
        log.removeHandler(recorder)


def test_completion_tables_print_bracketed_text():
    from fastppo.metrics import Samples, print_completions, print_samples

    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    print_completions(console, {"prompt": ["say [none]"], "completion": ["[none] [bold]x"], "[r]": [1.0]}, 1, [0])
    print_samples(console, Samples(["say [none]"], ["[none] [bold]x"], [1.0], extra={"tag": ["[ok]"]}), 1, None)
    text = out.getvalue()
    assert text.count("say [none]") == 2 and text.count("[none] [bold]x") == 2
    assert "[r]" in text and "[ok]" in text
