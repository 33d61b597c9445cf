"""Where the default tiny model lives, built on first use.

`default_model_path()` returns `<cache>/tiny-kimi-linear`, where `<cache>` is
`$SPLITSERVE_CACHE_DIR` or `~/.cache/splitserve`. The first call builds the "tiny" preset there;
concurrent first calls (several test workers, several Ray actors) serialise on a file lock, and
the checkpoint appears by one `os.replace` of a folder built beside it, so no caller ever sees a
half-written checkpoint. A checkpoint built by an older recipe is rebuilt. Torch-free at import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from splitserve.tiny_model import RECIPE_FILE, RECIPE_VERSION, make_tiny_model

CACHE_DIR_ENV = "SPLITSERVE_CACHE_DIR"
DEFAULT_MODEL_NAME = "tiny-kimi-linear"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """The folder that holds splitserve's cached models (not created here)."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitserve"


def default_model_path() -> Path:
    """Return the default tiny checkpoint's folder, building it there first if needed."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_current(target):  # another process built it while this one waited
            return target
        if target.exists() and not (target / RECIPE_FILE).exists():
            raise RuntimeError(
                f"{target} exists but is not a splitserve tiny model (no {RECIPE_FILE}); "
                f"move it away or point {CACHE_DIR_ENV} at another folder"
            )
        _build_atomically(target)
    return target


def _build_atomically(target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
    try:
        make_tiny_model(staging, preset="tiny", seed=0)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        if target.exists():  # an older recipe: swap it out, then delete it
            stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.stale.", dir=target.parent))
            os.replace(target, stale / DEFAULT_MODEL_NAME)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_current(path: Path) -> bool:
    if not all((path / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        recipe = json.loads((path / RECIPE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recipe.get("version") == RECIPE_VERSION and recipe.get("preset") == "tiny"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
