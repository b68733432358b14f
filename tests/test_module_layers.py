"""The package's shape, from its imports (module level, ``TYPE_CHECKING`` blocks included: a type-only import is
still a dependency its reader follows, issue 63 item 8): no import circle among ``fastppo``'s modules, the kernel
library standalone (``fastppo.kernels`` imports nothing else of fastppo), and the ways in (the trainers, the legacy
adapter, the command line) imported by no module below them. docs/design.md ("Why the package is flat") lists the
floors this computes and why they are not folders."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fastppo"
# the ways in, each importable only by another way in
WAYS_IN = {"trainer", "grpo", "rloo", "legacy", "cli", "api"}


def imports(path: Path) -> set[str]:
    """The ``fastppo`` modules ``path`` imports at module level, under ``if TYPE_CHECKING:`` too (``fastppo.x.y``
    counts as ``x``)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "fastppo":
                parts = n.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in n.names])
            elif isinstance(n, ast.Import):
                found.update(a.name.split(".")[1] for a in n.names if a.name.startswith("fastppo."))
    return found


def graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules.update({p.name: p / "__init__.py" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()})
    edges = {name: imports(path) & set(modules) - {name} for name, path in modules.items()}
    for package in ("kernels", "integrations"):  # a subpackage's modules all count as the subpackage
        for path in (PACKAGE / package).glob("*.py"):
            edges[package] |= imports(path) & set(modules) - {package}
    return edges


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 without fastppo imports, else one above its highest import; a circle raises."""
    floor: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> int:
        if name in path:
            raise AssertionError(f"import circle: {' -> '.join(path + (name,))}")
        if name not in floor:
            floor[name] = 1 + max((visit(d, path + (name,)) for d in edges[name]), default=-1)
        return floor[name]

    for name in edges:
        visit(name, ())
    return floor


def test_no_import_circle():
    floor = floors(graph())
    assert max(floor.values()) >= 5  # the graph is real: several floors


def test_type_only_imports_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` is an edge of the graph (a circle through one is a circle)."""
    module = tmp_path / "typed.py"
    module.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from fastppo.config import "
                      "PPOConfig\n    import fastppo.rollout\n")
    assert imports(module) == {"config", "rollout"}


def test_the_kernel_library_stands_alone():
    assert graph()["kernels"] == set()


def test_the_ways_in_are_imported_by_no_module_below_them():
    up = {(name, d) for name, deps in graph().items() if name not in WAYS_IN for d in deps & WAYS_IN}
    assert not up, f"modules importing a trainer or a command line: {sorted(up)}"


def test_the_floors_in_the_design_doc_are_the_imports():
    import re

    doc = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = doc[doc.index("## Why the package is flat"):doc.index("## Design decisions")]
    written = {name: int(f) for f, row in re.findall(r"^\| (\d+) \| (.*) \|$", table, re.M)
               for name in re.findall(r"`(\w+)`", row)}
    floor = floors(graph())
    assert written == {name: floor[name] for name in written}
    assert set(written) >= set(floor) - {"integrations"}, set(floor) - set(written)


CLASS_LINES = 450  # the house's bound: a class a reader can hold (issue 63 item 8)


def test_every_class_is_one_a_reader_can_hold():
    """Every class of fastppo is at most ``CLASS_LINES`` lines, its docstring included; a dataclass (a table of
    fields, each with its help: ``PPOConfig``) aside. ``PPOTrainer`` stays TRL 0.26's PPO trainer: what TRL 1.16's
    GRPOTrainer added lives in its adapters and named parts (``grpo_rollouts``), not in its class."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > CLASS_LINES:
                long.append(f"{path.relative_to(PACKAGE.parent)}: {node.name} ({lines} lines)")
    assert not long, long
