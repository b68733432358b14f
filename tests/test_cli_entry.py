"""The command line's entry as a newcomer meets it (issue 63): ``--help`` printed without importing torch or
transformers (from ``fastppo/cli_help.json``, the same text as the parser's), and a refusal under torchrun that is
the last thing on screen (torchrun's summary of the failed worker), with a non-zero exit status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fastppo import cli_help
from fastppo.cli import build_parser, main_guard, parse_args
from fastppo.errors import SettingsError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers", "fastppo.config", "fastppo.trainer")


def imported(importtime_log: str) -> set[str]:
    """The modules a ``python -X importtime`` run imported, from its log."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


def test_saved_help_is_the_parsers(monkeypatch):
    saved = json.loads(open(cli_help.HELP_FILE).read())
    assert saved == json.loads(json.dumps(cli_help.saved_help(build_parser()))), (
        "fastppo/cli_help.json is not the parser's help (a flag or transformers changed): python -m fastppo.cli_help")
    for columns in ("60", "200"):  # argparse lays both out at the terminal's width
        monkeypatch.setenv("COLUMNS", columns)
        assert cli_help.parser_from(saved["parser"]).format_help() == build_parser().format_help()


@pytest.mark.parametrize("entry", ["python -m fastppo.train", "fastppo-train (fastppo.cli:main)"])
def test_help_imports_neither_torch_nor_transformers(entry, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    if entry.startswith("python"):
        cmd = [sys.executable, "-X", "importtime", "-m", "fastppo.train", "--help"]
    else:  # what the console script runs
        cmd = [sys.executable, "-X", "importtime", "-c", "import sys; from fastppo.cli import main; sys.exit(main())",
               "--help"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)  # cwd: this checkout's fastppo
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    heavy = {m for m in imported(proc.stderr) if m.startswith(HEAVY)}
    assert not heavy, sorted(heavy)[:10]
    assert proc.stdout == build_parser().format_help()
    assert seconds < 3, f"--help took {seconds:.1f} s"  # 13.7 s before (issue 63); ~0.5 s on 2 loaded cores


def test_help_is_asked_as_argparse_reads_it():
    assert cli_help.asks_for_help(["--learning_rate", "1", "-h"]) and cli_help.asks_for_help(["--help"])
    assert not cli_help.asks_for_help(["--", "--help"]) and not cli_help.asks_for_help(["--hel"])


def test_saved_help_under_another_transformers_is_not_used(tmp_path, monkeypatch, capsys):
    saved = json.loads(open(cli_help.HELP_FILE).read())
    other = tmp_path / "cli_help.json"
    other.write_text(json.dumps({**saved, "transformers": "0.0.1"}))
    assert not cli_help.print_saved_help(str(other)) and capsys.readouterr().out == ""
    assert cli_help.print_saved_help() and "--learning_rate" in capsys.readouterr().out


def test_refusals_are_left_for_torchruns_summary(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def shown():  # what torchrun prints of a record: its py_callstack (torch.distributed.elastic's format)
        return json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]

    with pytest.raises(SystemExit) as e:  # argparse's refusal of a bad value
        parse_args(["--learning_rate", "abc"])
    assert e.value.code == 2
    assert "python -m fastppo.train: error: argument --learning_rate/--learning-rate: invalid float value: 'abc'" \
        in capsys.readouterr().err.splitlines()
    assert shown() == "python -m fastppo.train: error: argument --learning_rate/--learning-rate: invalid float " \
        "value: 'abc'"

    def refused():
        raise SettingsError("--output_dir 'out' already holds a run")

    with pytest.raises(SystemExit) as e:
        main_guard(refused)
    assert e.value.code == 2 and shown() == "fastppo.train: error: --output_dir 'out' already holds a run"
    error_file.unlink()
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    with pytest.raises(SystemExit):
        main_guard(refused)
    assert not error_file.exists()  # without torchrun, stderr only


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_the_last_thing_on_screen(tmp_path):
    """Refused while the flags are read (before any model or dataset loads): torchrun's report ends with it."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # this checkout's fastppo
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "fastppo.train", "--chat_template_kwargs", "[1]", "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode != 0
    last = proc.stdout.rstrip().splitlines()[-3:]
    assert any("fastppo.train: error: chat_template_kwargs must be a dict" in line for line in last), \
        proc.stdout[-3000:]
