"""Every repository path the documentation names exists, and every relative Markdown link resolves.

Where paths are looked for:

* ``README.md`` and ``docs/*.md``: the whole text, code blocks included;
* ``fastppo/**/*.py`` and ``bench/*.py``: comments and string literals (docstrings among them), read with
  ``tokenize``.

What counts as a path:

1. a token that starts with one of this repository's top-level directories, ``fastppo/``, ``tests/``,
   ``bench/``, ``docs/``, ``csrc/``, ``examples/`` or ``.ci/``, and runs on over ``[A-Za-z0-9_./-]``; it must
   not be glued to a word, ``.``, ``/`` or ``-`` before it (``trl/tests/x.py`` and ``huggingface.co/docs/...``
   are other places), but may be reached through ``../`` (a link from ``docs/``). Trailing ``.`` and ``-``
   are punctuation, not part of it. It names a file or a directory relative to the repository root;
2. a bare top-level file name: ``pyproject.toml``, ``setup.py``, or an upper-case Markdown name
   (``README.md``, ``DESIGN.md``, ...), not preceded by ``/`` or a word character: a file at the root;
3. the target of a Markdown link ``[text](target)`` in README.md or docs/*.md that is not a URL (``http:``,
   ``https:``, ``mailto:``): resolved from the linking file's directory; its ``#anchor``, if any, must be a
   heading of the target Markdown file (GitHub's slugs).

Skipped, by rule: a token of rule 1 followed at once by ``<``, ``*``, ``?``, ``{``, ``[`` or ``$`` (a
placeholder or a glob such as ``tests/test_<kernel>.py`` or ``bench/bench_*.py``); and the paths of other
repositories that the docs name on purpose, listed in ``OTHER_REPOSITORIES`` with whose they are.
"""
from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = sorted((ROOT / "fastppo").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))

# Other repositories' files, named as theirs: TRL's test files and example scripts that tests/trl_acceptance.py
# runs against fastppo, and verl's docs.
OTHER_REPOSITORIES = {
    "tests/experimental/test_ppo_trainer.py": "TRL v0.26.2",
    "tests/test_ppo_trainer.py": "TRL v0.11.4",
    "tests/test_modeling_value_head.py": "TRL v0.11.4",
    "examples/scripts/ppo/ppo.py": "TRL v0.26.2",
    "examples/scripts/ppo/ppo_tldr.py": "TRL v0.26.2",
    "examples/scripts/ppo.py": "TRL v0.11.4",
    "docs/algo/grpo.md": "verl",  # docs/policy_loss_names.md cites verl's docs
    "docs/algo/dapo.md": "verl",
}

PATH = re.compile(r"(?<![\w./-])(?:\.\./)*((?:fastppo|tests|bench|docs|csrc|examples|\.ci)/[\w./-]*)")
TOP_LEVEL = re.compile(r"(?<![\w/.-])(pyproject\.toml|setup\.py|[A-Z][A-Z0-9_]*\.md)(?![\w/-])")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
PLACEHOLDER = set("<*?{[$")


def paths_in(text: str) -> list[str]:
    found = []
    for m in PATH.finditer(text):
        if m.end() < len(text) and text[m.end()] in PLACEHOLDER:
            continue
        path = m.group(1).rstrip(".-")
        if path not in OTHER_REPOSITORIES:
            found.append(path)
    return found + TOP_LEVEL.findall(text)


def python_text(path: Path) -> str:
    """The comments and string literals of a Python file, one per line."""
    parts = []
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                parts.append(tok.string)
    return "\n".join(parts)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def sources() -> list[tuple[str, str]]:
    return ([(p.relative_to(ROOT).as_posix(), p.read_text()) for p in MARKDOWN]
            + [(p.relative_to(ROOT).as_posix(), python_text(p)) for p in PYTHON])


@pytest.mark.parametrize("name, text", sources(), ids=[name for name, _ in sources()])
def test_named_paths_exist(name, text):
    missing = sorted({p for p in paths_in(text) if not (ROOT / p).exists()})
    assert not missing, f"{name} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", MARKDOWN, ids=[p.relative_to(ROOT).as_posix() for p in MARKDOWN])
def test_markdown_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"(https?|mailto):", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(f"{target} (no {file})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT).as_posix()})")
    assert not broken, f"{doc.relative_to(ROOT).as_posix()}: broken links: {broken}"


def test_the_rules_find_what_they_should():
    """The path rules on examples: what is a path, what is skipped."""
    text = ("see `fastppo/kernels/_lmhead.py` (L7), bench/RESULTS.md. and [x](../bench/RESULTS.md); "
            "trl/tests/test_ppo_trainer.py, https://huggingface.co/docs/trl/x.md, tests/test_<kernel>.py, "
            "bench/bench_*.py, tests/experimental/test_ppo_trainer.py; README.md, refine DESIGN.md")
    assert paths_in(text) == ["fastppo/kernels/_lmhead.py", "bench/RESULTS.md", "bench/RESULTS.md",
                              "README.md", "DESIGN.md"]
    assert slug("The policy loss: TRL GRPO's `loss_type`, clip-higher, GSPO") == \
        "the-policy-loss-trl-grpos-loss_type-clip-higher-gspo"
