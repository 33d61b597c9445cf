"""scripts/install.sh picks the torch build for the machine itself, not from whatever wheel
happens to lie around: run against a stand-in venv whose `pip` records what it was asked."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run_install(tmp_path: Path, *, gpu: bool, **env: str) -> list[str]:
    """Run install.sh with a venv whose python has no torch; return the pip command lines."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    log = tmp_path / "pip.log"
    _executable(venv / "bin" / "python", "#!/bin/sh\nexit 1\n")  # `python -c "import torch"` fails
    _executable(venv / "bin" / "pip", f'#!/bin/sh\necho "$*" >> {log}\n')
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\n')
    if gpu:
        _executable(tools / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    path = f"{tools}:/usr/bin:/bin"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env={"PATH": path, "HOME": str(tmp_path), "SPLITSERVE_VENV": str(venv), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return log.read_text().splitlines()


def test_without_a_gpu_the_cpu_build_comes_from_pytorchs_cpu_index(tmp_path):
    torch, package = _run_install(tmp_path, gpu=False)
    assert torch == f"install --quiet --index-url {CPU_INDEX} torch>=2.4"
    assert package == f"install --quiet -e {ROOT}[engine]"


def test_with_a_gpu_pypis_cuda_build_and_an_index_or_version_can_be_chosen(tmp_path):
    assert _run_install(tmp_path / "a", gpu=True)[0] == "install --quiet torch>=2.4"
    chosen = _run_install(
        tmp_path / "b",
        gpu=True,
        SPLITSERVE_TORCH_INDEX_URL="https://download.pytorch.org/whl/cu126",
        SPLITSERVE_TORCH="torch==2.7.1",
    )
    assert chosen[0] == "install --quiet --index-url https://download.pytorch.org/whl/cu126 torch==2.7.1"


def test_the_base_install_installs_no_torch(tmp_path):
    assert _run_install(tmp_path, gpu=False, SPLITSERVE_EXTRAS="") == [f"install --quiet -e {ROOT}"]
