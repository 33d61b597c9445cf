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
    # `pip download` finds a local wheel only where the test says one lies on the machine
    _executable(
        venv / "bin" / "pip",
        f'#!/bin/sh\necho "$*" >> {log}\n'
        'if [ "$1" = download ]; then\n'
        '  [ -n "$LOCAL_TORCH_WHEEL" ] || exit 1\n'
        '  while [ "$1" != --dest ]; do shift; done\n'
        '  touch "$2/$LOCAL_TORCH_WHEEL"\n'
        "fi\n",
    )
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


def test_without_a_gpu_or_a_local_wheel_the_cpu_build_comes_from_pytorchs_cpu_index(tmp_path):
    looked, torch, package = _run_install(tmp_path, gpu=False)
    assert looked.startswith("download --quiet --no-index --no-deps --dest ")
    assert torch == f"install --quiet --index-url {CPU_INDEX} torch>=2.4"
    assert package == f"install --quiet -e {ROOT}[engine]"


def test_without_a_gpu_a_local_torch_wheel_is_installed_by_its_file(tmp_path):
    wheel = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    looked, torch, package = _run_install(tmp_path, gpu=False, LOCAL_TORCH_WHEEL=wheel)
    assert looked.endswith(" torch>=2.4")
    assert torch.startswith("install --quiet /") and torch.endswith("/" + wheel)
    assert CPU_INDEX not in torch
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
