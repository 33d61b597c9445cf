"""Imports run one way: core library <- components <- deploy <- entry points.

Every `import` statement in the project's packages is read (those inside functions too), so a
lazy import that breaks the direction fails here as surely as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = {"splitserve"}
COMPONENTS = {"frontend", "prefill_worker", "decode_worker", "colocated_worker", "state_store"}
DEPLOY = {"deploy"}
ENTRY_POINTS = {"cli", "bench", "experiments"}
PACKAGES = CORE | COMPONENTS | DEPLOY | ENTRY_POINTS


def allowed_imports(package: str) -> set[str]:
    """The project packages `package` may import (besides itself)."""
    if package in CORE:
        return set()
    if package in COMPONENTS:
        return set(CORE)  # components talk to each other only through proto/ (splitserve.v1)
    if package in DEPLOY:
        return CORE | COMPONENTS
    return PACKAGES


def imported_packages(path: Path) -> set[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `path` that names a project package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update((node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in PACKAGES)
    return found


def test_every_package_is_accounted_for():
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "build"}
    assert on_disk == PACKAGES, "a new top-level package needs a place in the import direction"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_run_one_way(package):
    allowed = allowed_imports(package) | {package}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, target in sorted(imported_packages(path))
        if target not in allowed
    ]
    assert not wrong, f"{package} may import only {sorted(allowed)}:\n" + "\n".join(wrong)


def test_the_check_catches_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def later():\n    from frontend.app import build_app\n")
    assert imported_packages(bad) == {(2, "frontend")}
    assert "frontend" not in allowed_imports("splitserve")
