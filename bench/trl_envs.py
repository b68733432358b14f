"""Where the two TRL peers live, for the bench and the tests.

TRL 1.16 (``GRPOTrainer``/``RLOOTrainer``, the critic-free peer) is the TRL of the user's environment: the ``[trl]``
extra installs it, and the ``[test]`` extra with it, so the README's TRL 1.x snippets run in the README's venv.
TRL 0.26.2, the last TRL with ``PPOTrainer`` (the PPO peer), cannot share that environment, so it lives in its own
directory, ``.trl026`` (or ``$FASTPPO_TRL026``), filled with ``pip install --no-deps --target .trl026 trl==0.26.2``
(its dependencies are the environment's), and goes first on ``sys.path`` only where the PPO peer runs
(:func:`use_trl026`). ``$FASTPPO_TRL1`` names a separate TRL 1.x directory instead of the environment's.
"""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL026_INSTALL = ".venv/bin/pip install --no-deps --target .trl026 trl==0.26.2"
TRL1_INSTALL = '.venv/bin/pip install --no-build-isolation -e ".[trl]"'


def trl1_dir() -> str:
    """The directory holding TRL 1.x: ``$FASTPPO_TRL1``, else this environment's site-packages."""
    return os.environ.get("FASTPPO_TRL1") or sysconfig.get_paths()["purelib"]


def trl1_missing() -> str | None:
    """Why TRL 1.x cannot be imported from :func:`trl1_dir` (with the command that installs it), or None."""
    path = trl1_dir()
    versions = [os.path.basename(p)[len("trl-"):-len(".dist-info")]
                for p in glob.glob(os.path.join(path, "trl-*.dist-info"))]
    if not os.path.isfile(os.path.join(path, "trl", "__init__.py")) or not versions:
        return f"TRL 1.x is missing at {path}: run `{TRL1_INSTALL}` (see the README's test command)"
    if not any(v.startswith("1.") for v in versions):
        return f"the TRL at {path} is {versions[0]}, not 1.x: run `{TRL1_INSTALL}`"
    return None


def trl026_dir() -> str:
    return os.environ.get("FASTPPO_TRL026") or os.path.join(REPO, ".trl026")


def use_trl026() -> bool:
    """Put TRL 0.26 first on ``sys.path`` so that this process's next ``import trl`` is the PPO peer's; False when it
    is not installed (the PPO peer's ``trl_version()`` then reports it missing). Child processes that run the peer
    import it through ``trl_peer`` themselves, so ``PYTHONPATH`` is left alone: a test process that imported the
    bench hands no TRL 0.26 to its later children."""
    path = trl026_dir()
    if not os.path.isfile(os.path.join(path, "trl", "__init__.py")):
        return False
    if path not in sys.path:
        sys.path.insert(0, path)
    return True
