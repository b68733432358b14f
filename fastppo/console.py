"""What the console shows while a run trains, as transformers' ``Trainer`` shows it to TRL's users: a tqdm bar over
the run's global steps with its ETA (``ProgressCallback``'s: on standard error, main process only, none under
``disable_tqdm``), the console's printing kept off the bar (its lines are ``tqdm.write``'s), and the line per logged
step in TRL's names: TRL GRPO's (``reward``, per-token ``entropy``, ...) for a critic-free run, TRL 0.26 PPO's
(``objective/scores``, ...) for PPO.
"""
from __future__ import annotations

import sys

from tqdm.auto import tqdm

# The line's metrics, in order, each shown where the row has it (a row after the first of a generation batch has no
# reward: TRL logs the generation's metrics once, in the first row after it). TRL GRPO's and RLOO's names and their
# definitions (the row's own values: per-token entropy, the reward's mean and std over every process), then
# transformers' two; PPO: TRL 0.26's names (objective/entropy is a sum over each completion's tokens), and TRL GRPO's
# in-loss ``kl`` where beta sets one.
CRITIC_FREE_NAMES = ("reward", "reward_std", "entropy", "kl", "loss", "grad_norm", "learning_rate")
PPO_NAMES = ("objective/scores", "objective/kl", "kl", "objective/entropy", "loss/value_avg")


def step_line(row: dict, critic_free: bool) -> str:
    """The console's metrics of a logged step: ``row`` (its log_history entry) under TRL's names, formatted as
    transformers' ``ProgressCallback`` formats a float (4 significant digits)."""
    names = CRITIC_FREE_NAMES if critic_free else PPO_NAMES
    return " ".join(f"{name} {row[name]:.4g}" for name in names if isinstance(row.get(name), (int, float)))


def step_bar(total: int, done: int) -> tqdm:
    """``ProgressCallback``'s bar: ``done`` of ``total`` global steps (a resumed run starts where it stopped, so
    the ETA counts only the steps this process runs), on standard error; tqdm writes its frames there whether or not
    it is a terminal, as transformers leaves it, while the console's lines go to standard output
    (``StdoutBesideBar``): redirected, standard output holds the lines alone."""
    return tqdm(total=total, initial=done, dynamic_ncols=True)


class StdoutBesideBar:
    """Standard output for the console (``rich.console.Console(file=...)``): each write clears a live bar first
    and draws it again after (tqdm's ``external_write_mode``, what ``tqdm.write`` does), so a line never lands in
    the middle of the bar. ``sys.stdout`` is read at each call: a stream swapped in later (pytest's capture,
    ``contextlib.redirect_stdout``) is the one written to."""

    def write(self, text: str) -> int:
        if sys.stdout is None:  # no standard output (pythonw): nothing to show, as rich's own NULL_FILE
            return len(text)
        with tqdm.external_write_mode(file=sys.stdout):
            return sys.stdout.write(text)

    def flush(self) -> None:
        if sys.stdout is not None:
            sys.stdout.flush()

    def isatty(self) -> bool:  # rich decides colours and markup from it
        return sys.stdout is not None and sys.stdout.isatty()

    def __getattr__(self, name: str):  # fileno, encoding, ...: the stream's own
        return getattr(sys.stdout, name)
