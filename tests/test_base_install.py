"""A GPU-less node's install: `pip install splitserve` (no extras) runs the gateway, the store,
the controller, the `splitserve` command and the bench client.

The first test keeps the engine's dependencies out of the base list and out of everything that
list pulls in. The second imports every module such a node loads in a child process whose
import system refuses any third-party module that the base dependencies do not provide, so a
new top-level `import transformers` (or of any package only the dev or engine extras install)
in the gateway fails here rather than on a gateway node.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.python_process import run_python

ROOT = Path(__file__).resolve().parents[1]
ENGINE_DISTRIBUTIONS = {"torch", "transformers", "safetensors"}
NEVER_IN_BASE = ENGINE_DISTRIBUTIONS | {"triton"}  # CUDA builds of torch bring triton
# What a gateway, store-only or head node imports: these packages whole (the core without its
# torch engine), and the worker actor modules the controller on the head node loads to start
# workers elsewhere.
BASE_PACKAGES = ("splitserve", "frontend", "state_store", "deploy", "bench", "cli")
ENGINE_PACKAGE = "splitserve.engine"
WORKER_ACTORS = ("prefill_worker.actor", "decode_worker.actor", "colocated_worker.actor")

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib (3.11+)")


def _pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _closure(requirements: list[str]) -> set[str]:
    """Canonical names of the installed distributions these requirements pull in, transitively."""
    expanded: dict[str, set[str]] = {}  # distribution -> the extras already followed
    todo = [req for req in map(Requirement, requirements) if req.marker is None or req.marker.evaluate()]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        new_extras = ({""} | set(req.extras)) - expanded.get(name, set())
        if not new_extras:
            continue
        expanded.setdefault(name, set()).update(new_extras)
        try:
            lines = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            raise AssertionError(f"{req.name} is required by the base install but is not installed here") from None
        for child in map(Requirement, lines):
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in new_extras):
                todo.append(child)
    return set(expanded)


def _base_dependencies() -> list[str]:
    return list(_pyproject()["project"]["dependencies"])


def test_the_engine_is_an_extra_and_nothing_in_the_base_install_pulls_it_in():
    project = _pyproject()["project"]
    base = {canonicalize_name(Requirement(text).name) for text in project["dependencies"]}
    engine = {canonicalize_name(Requirement(text).name) for text in project["optional-dependencies"]["engine"]}
    assert not ENGINE_DISTRIBUTIONS - engine, f"the engine extra lacks {ENGINE_DISTRIBUTIONS - engine}"
    assert not base & NEVER_IN_BASE, f"base dependencies name engine packages: {base & NEVER_IN_BASE}"
    pulled = _closure(_base_dependencies())
    assert not pulled & NEVER_IN_BASE, f"the base install pulls in {pulled & NEVER_IN_BASE}"


def test_a_gpu_less_node_imports_with_the_base_dependencies_alone():
    allowed: set[str] = set()
    pulled = _closure(_base_dependencies())
    for module, distributions in metadata.packages_distributions().items():
        if any(canonicalize_name(d) in pulled for d in distributions):
            allowed.add(module)
    project = [p.rstrip("*") for p in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]]
    allowed.update(project)
    code = _CHILD.format(
        allowed=json.dumps(sorted(allowed)), packages=BASE_PACKAGES, skip=ENGINE_PACKAGE, modules=WORKER_ACTORS
    )
    assert run_python(code, timeout_s=300).startswith("imported")


# Runs in a fresh interpreter. Only top-level names found in site-packages are checked, by the folder
# they lie in; the standard library (private modules too) and what site loaded at start-up stay.
_CHILD = '''
import importlib, importlib.machinery, pkgutil, site, sys
allowed = set({allowed}) | {{m.split(".")[0] for m in sys.modules}}
site_dirs = tuple(site.getsitepackages())
refused = set()

class RefuseUndeclared:
    def find_spec(self, name, path=None, target=None):
        if path is not None or name in allowed:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name)
        locations = [spec.origin or ""] + list(spec.submodule_search_locations or []) if spec else []
        # Where in site-packages it lies: ray puts its own copies (ray/thirdparty_files) on sys.path.
        owners = {{loc[len(d):].lstrip("/").split("/")[0].split(".")[0]
                  for loc in map(str, locations) for d in site_dirs if loc.startswith(d + "/")}}
        if not owners or owners & allowed:
            return None
        refused.add(name)
        raise ModuleNotFoundError(f"{{name}} is not provided by the base dependencies", name=name)

sys.meta_path.insert(0, RefuseUndeclared())
def walk(package):
    """Import `package` and every module under it, except the engine (which needs torch)."""
    yield importlib.import_module(package)
    for info in pkgutil.iter_modules(sys.modules[package].__path__, package + "."):
        if info.name == {skip!r}:
            continue
        if info.ispkg:
            yield from walk(info.name)
        else:
            yield importlib.import_module(info.name)

imported = [importlib.import_module(name) for name in {modules}]
for package in {packages}:
    imported += list(walk(package))
print("imported", len(imported), "modules; refused optional imports:", sorted(refused))
'''
