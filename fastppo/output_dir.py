"""The output directory: whose files are in it (a fastppo run's, or another's, which fastppo never writes over or
deletes), a previous run's files, the one-writer lock, and which checkpoint a run there continues
(``decide_resume``). The checkpoints themselves are ``fastppo.checkpoint``'s."""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable

from fastppo.checkpoint import (CONFIG_FILE, check_compatible, checkpoints, finished_step, is_fastppo_checkpoint,
                                resolve_checkpoint, saved_step)
from fastppo.config import PPOConfig
from fastppo.errors import SettingsError


LOCK_FILE = ".fastppo.lock"


class RunLock:
    """One run writes an output_dir at a time: an exclusive ``flock`` on ``output_dir/.fastppo.lock``, taken
    before a run decides what to do with the directory and held until its last file is written. Two trainers
    built on one directory (in one process or two) cannot both write it; the kernel drops the lock when its
    process dies, so a crashed run never leaves a stale one. Where ``flock`` is missing (not Linux/macOS) or
    the filesystem refuses it, the lock is skipped."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.file = None

    def acquire(self) -> str | None:
        """None when held now; else who holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover
            return None
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        file = open(self.path, "a+")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            return holder
        except OSError:  # pragma: no cover  (a filesystem without flock)
            file.close()
            return None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()}")
        file.flush()
        self.file = file
        return None

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor drops the flock
            self.file = None


# What a fastppo run writes into output_dir (anything else there is the user's and is left alone).
RUN_FILES = re.compile(r"^(checkpoint-\d+|\.tmp-checkpoint-\d+|latest|metrics\.jsonl|samples\.jsonl|curves\.png|runs|"
                       r"completions|value_model|fastppo_config\.json|config\.json|generation_config\.json|"
                       r"model.*\.safetensors|"
                       r"model\.safetensors\.index\.json|adapter_.*|v_head\.safetensors|tokenizer.*|"
                       r"special_tokens_map\.json|chat_template\.jinja|vocab\.json|merges\.txt|trainer_state\.json)$")
# A checkpoint directory of any trainer: transformers' (and so TRL's) checkpoint-N, its tmp-checkpoint-N
# staging, fastppo's .tmp-checkpoint-N. fastppo's own hold its config (every version wrote it) or its state.
CHECKPOINT_LIKE = re.compile(r"^\.?(tmp-)?checkpoint-\d+$")
# Model, tokenizer and trainer files of any origin (a transformers Trainer's output, a downloaded model, a GGUF
# file): in a directory no fastppo run wrote they are the user's, and fastppo neither writes beside them nor
# deletes them.
MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors|.*\.safetensors\.index\.json|"
                         r"pytorch_model.*\.bin|.*\.bin\.index\.json|training_args\.bin|.*\.(gguf|pt|pth|ckpt|h5|"
                         r"msgpack|onnx)|adapter_.*|tokenizer.*|special_tokens_map\.json|chat_template\.jinja|"
                         r"vocab\.(json|txt)|merges\.txt|.*\.model|trainer_state\.json|all_results\.json|"
                         r"(train|eval)_results\.json|value_model|latest)$")


def _first_json_line(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline(1 << 20)
        row = json.loads(line)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) else None


def _fastppo_log(path: str, name: str) -> bool:
    """Whether ``metrics.jsonl``/``samples.jsonl`` has fastppo's lines (those of a run that stopped before its
    first checkpoint: the only trace it leaves). Every version's metrics lines carry ``step`` and TRL's
    ``objective/*`` names; its samples lines ``query``/``response`` (the legacy API's: ``step`` and ``reward``)."""
    row = _first_json_line(path)
    if row is None:
        return False
    if name == "metrics.jsonl":
        return "step" in row and any(k.startswith("objective/") for k in row)
    return ("iteration" in row and "response" in row and "score" in row) or ("step" in row and "reward" in row)


def fastppo_marker(output_dir: str) -> str | None:
    """What says ``output_dir`` holds a fastppo run (None: nothing does, whatever else is there): fastppo's
    config beside a final model, a checkpoint of fastppo's, or fastppo's metrics or samples lines."""
    if not os.path.isdir(output_dir):
        return None
    if os.path.isfile(os.path.join(output_dir, CONFIG_FILE)):
        return CONFIG_FILE
    names = sorted(os.listdir(output_dir))
    for name in names:
        if CHECKPOINT_LIKE.match(name) and is_fastppo_checkpoint(os.path.join(output_dir, name)):
            return f"{name}/"
    for name in ("metrics.jsonl", "samples.jsonl"):
        if name in names and _fastppo_log(os.path.join(output_dir, name), name):
            return name
    return None


def _shown(output_dir: str, name: str) -> str:
    return f"{name}/" if os.path.isdir(os.path.join(output_dir, name)) else name


def foreign_files(output_dir: str) -> list[str]:
    """What in ``output_dir`` no fastppo run wrote and a fastppo run would write over or delete: another trainer's
    checkpoints (a transformers or TRL Trainer's ``checkpoint-N/``), model, tokenizer or trainer files beside
    which fastppo wrote no config (a Trainer's final model, a downloaded or hand-made checkpoint), and, in a
    directory without any fastppo marker, the files a run would write (metrics, samples, curves). fastppo never
    writes into a directory that holds any of them, ``--overwrite_output_dir`` included; ``runs/`` alone
    (tensorboard logs, which a run only adds to) is not among them."""
    if not os.path.isdir(output_dir):
        return []
    marker = fastppo_marker(output_dir)
    own_top = os.path.isfile(os.path.join(output_dir, CONFIG_FILE))
    found = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if CHECKPOINT_LIKE.match(name):
            if os.path.isdir(path) and not is_fastppo_checkpoint(path):
                found.append(name)
        elif MODEL_FILES.match(name):
            if name == "latest" and marker is not None:
                continue  # fastppo's pointer to its newest checkpoint
            if not own_top:
                found.append(name)
        elif marker is None and RUN_FILES.match(name) and name != "runs":
            found.append(name)
    return [_shown(output_dir, name) for name in found]


def describe_foreign(output_dir: str, found: list[str]) -> str:
    """What ``found`` (``foreign_files``) looks like, for the refusal: whose output it is, then the names."""
    names = [n.rstrip("/") for n in found]
    trainer_dirs = [n for n in names if CHECKPOINT_LIKE.match(n)]
    if ("trainer_state.json" in names or "training_args.bin" in names
            or any(os.path.isfile(os.path.join(output_dir, n, "trainer_state.json")) for n in trainer_dirs)):
        what = "a transformers/TRL Trainer's output"
    elif trainer_dirs:
        what = "another trainer's checkpoints"
    elif "adapter_config.json" in names:
        what = "a PEFT adapter"
    elif "config.json" in names or any(n.endswith((".safetensors", ".bin", ".gguf")) for n in names):
        what = "a model"
    else:
        what = "files"
    shown = []
    for name in found:  # a checkpoint directory is shown with the files that say whose it is
        path = os.path.join(output_dir, name.rstrip("/"))
        inside = [f for f in ("trainer_state.json", "training_args.bin", "optimizer.pt")
                  if CHECKPOINT_LIKE.match(name.rstrip("/")) and os.path.isfile(os.path.join(path, f))]
        shown.append(f"{name} holding {inside[0]}" if inside else name)
    more = f", and {len(shown) - 8} more" if len(shown) > 8 else ""
    return f"{what} ({', '.join(shown[:8])}{more})"


def said(name: str, command_line: bool, value: str = "") -> str:
    """A setting as its caller writes it: a flag of fastppo's command line (``--name value``), a keyword to a
    Python caller of the TRL API (``name=value``)."""
    return f"--{name} {value}".rstrip() if command_line else f"{name}={value}"


def refuse_foreign(output_dir: str, what: str | None = None, command_line: bool = False) -> None:
    """A SettingsError naming what in ``output_dir`` no fastppo run wrote (``foreign_files``), if anything: fastppo
    writes nothing there, so the way out is another directory (``overwrite_output_dir`` does not change it).
    ``what``: the directory's name in the message (None: the output_dir setting, in the caller's words)."""
    found = foreign_files(output_dir)
    if found:
        head = said("output_dir", command_line, repr(output_dir)) if what is None else f"{what} {output_dir!r}"
        raise SettingsError(
            f"{head} holds {describe_foreign(output_dir, found)}: files that no fastppo run wrote. "
            f"fastppo never writes over or deletes them, "
            f"{said('overwrite_output_dir', command_line, '' if command_line else 'True')} "
            f"included: use another {said('output_dir', command_line).rstrip('=') if what is None else 'directory'}")


def run_files(output_dir: str) -> list[str]:
    """The files and directories of a previous fastppo run in ``output_dir`` (none where no fastppo marker is:
    ``fastppo_marker``; never another trainer's checkpoint directory)."""
    if fastppo_marker(output_dir) is None:
        return []
    own_top = os.path.isfile(os.path.join(output_dir, CONFIG_FILE))
    return sorted(name for name in os.listdir(output_dir) if RUN_FILES.match(name)
                  and (is_fastppo_checkpoint(os.path.join(output_dir, name)) if CHECKPOINT_LIKE.match(name)
                       else own_top or not MODEL_FILES.match(name) or name == "latest"))


def remove_run_files(output_dir: str) -> None:
    """Delete a previous fastppo run's files (``run_files``: only where fastppo's marker is, only fastppo's)."""
    for name in run_files(output_dir):
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


# ============================================================================ which run this one continues


def replaces_earlier_run(config: PPOConfig, command_line: bool) -> bool:
    """Whether a new run into an output_dir holding an earlier fastppo run replaces that run's files. From Python
    (the TRL API), yes, as TRL's Trainer writes over an earlier run (its GRPOConfig has no overwrite_output_dir);
    fastppo's command line only with ``--overwrite_output_dir``, and refuses otherwise."""
    return config.overwrite_output_dir or not command_line


def decide_resume(config: PPOConfig, model_args, world_size: int, zero_stage: int | None, total_iterations: int,
                  log: Callable[[str], None] | None, command_line: bool = False) -> str | None:
    """Which checkpoint this run continues (None: a fresh run), and whether the output_dir may be written:
    decided before any model loads, and again when ``train()`` starts writing (under the directory's
    lock). A previous run there is never silently mixed: it is continued when asked, else replaced
    (``replaces_earlier_run``: a Python caller, or ``--overwrite_output_dir``) or, on the command line, refused.
    ``log``: where the notes go (None: not again); ``command_line``: the messages' words are flags, else
    keywords."""
    notes_to = log or (lambda _: None)
    spec = config.resume_from_checkpoint
    if spec is True or (isinstance(spec, str) and spec.lower() == "true"):
        spec = "latest"  # transformers' meaning of True: the newest checkpoint in output_dir
    elif spec is False or (isinstance(spec, str) and spec.lower() == "false"):
        spec = None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if spec is None and restarted:  # torchrun --max-restarts: carry on from the last checkpoint, if any
        spec = "latest" if checkpoints(config.output_dir) else None
        if spec:
            notes_to("elastic restart: resuming from the latest checkpoint")
    # a directory no fastppo run wrote (a transformers Trainer's output, the policy's own source): never written
    refuse_foreign(config.output_dir, command_line=command_line)
    existing = run_files(config.output_dir)  # a fastppo run's files: only where fastppo's own marker is
    if spec is not None:
        path = resolve_checkpoint(spec, config.output_dir, log=notes_to)

        for note in check_compatible(path, config, world_size, zero_stage, model_args):
            notes_to(note)
        _check_resume_keeps_outputs(config, total_iterations, path, existing, command_line)
        return path
    if existing and not replaces_earlier_run(config, command_line) and not restarted:
        resumable = checkpoints(config.output_dir)
        raise SettingsError(
            f"--output_dir {config.output_dir!r} already holds a run ({', '.join(existing[:6])}"
            f"{', ...' if len(existing) > 6 else ''}); "
            + ("pass --resume_from_checkpoint latest to continue it, " if resumable else
               "it has no checkpoint to continue from: ")
            + "--overwrite_output_dir to replace it, or another --output_dir"
        )
    return None


def _check_resume_keeps_outputs(config: PPOConfig, total: int, path: str, existing: list[str],
                                command_line: bool) -> None:
    """A resume may redo what came after its checkpoint only where nothing finished lies there: the
    iterations past a crash are lost anyway, but a finished run's final model and metrics are not."""
    output_dir = said("output_dir", command_line, repr(config.output_dir))
    step = saved_step(path)
    if step >= total:
        raise SettingsError(
            f"{path} is after iteration {step}, and this run has {total} iteration(s) in all (max_steps / "
            "total_episodes): nothing is left to train; raise max_steps or total_episodes to train further")
    inside = os.path.abspath(os.path.dirname(path)) == os.path.abspath(config.output_dir)
    final = finished_step(config.output_dir)
    if final is not None and final > step:
        how = (f"--resume_from_checkpoint {path} --output_dir NEW" if command_line else
               f"resume_from_checkpoint={path!r} with another output_dir")
        raise SettingsError(
            f"{output_dir} holds a finished run's final model (iteration {final}), newer than "
            f"{os.path.basename(path)}: resuming there would replace that model and drop the metrics after "
            f"iteration {step}; to redo from the checkpoint, resume into another directory ({how})")
    if not inside and existing and not replaces_earlier_run(config, command_line):
        raise SettingsError(
            f"{output_dir} already holds a run ({', '.join(existing[:6])}), and "
            f"{path} is another directory's checkpoint: resume into an empty --output_dir, or pass "
            "--overwrite_output_dir to replace that run")
