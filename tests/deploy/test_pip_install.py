"""What a plain `pip install` of the package gives a deployer, off this checkout: built as a wheel
from a copy of the sources, installed into a folder of its own, run from elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_EXAMPLE = ROOT / "deploy" / "configs" / "gpu-cluster.yaml"
# what a wheel needs no copy of (and what a build leaves behind in the tree)
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests"
)


def _pip(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr


def test_a_pip_installed_package_plans_the_gpu_example_from_the_shipped_model_config(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCES)
    _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "--wheel-dir",
        str(tmp_path / "wheels"),
        ".",
        cwd=source,
    )
    (wheel,) = (tmp_path / "wheels").glob("splitserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "deploy/configs/models/Kimi-Linear-48B-A3B-Instruct/config.json" in names
    examples = {
        "deploy/configs/gpu-cluster.yaml",
        "deploy/kuberay/raycluster.yaml",
        "deploy/onprem/ray-cluster.yaml",
    }
    assert examples <= set(names)
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "--quiet", "--target", str(site), str(wheel), cwd=tmp_path)

    env = {**os.environ, "PYTHONPATH": str(site)}
    plan = subprocess.run(
        [sys.executable, "-m", "cli.main", "config", "plan", str(GPU_EXAMPLE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    shipped = site / "deploy" / "configs" / "models" / "Kimi-Linear-48B-A3B-Instruct" / "config.json"
    assert f"model config: {shipped} (shipped copy;" in plan.stdout
    assert "prefill: fits" in plan.stdout and "decode: fits" in plan.stdout
