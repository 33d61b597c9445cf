"""Regenerates the checked-in Python stubs for every `.proto` here: `python proto/generate.py`.

The sources follow buf's layout (the directory matches the proto package): `splitserve/v1/*.proto`
under this folder, package `splitserve.v1`. They are compiled with this folder as the include
root, so the stubs land in the Python package `splitserve.v1` (`splitserve/v1/*_pb2*.py` at the
repository root) and import each other as `from splitserve.v1 import common_pb2`.
`--out DIR` writes under `DIR/splitserve/v1/` instead (the sync test compares the two).

The stubs are not generated into a top-level `proto` package: that name belongs to proto-plus,
which Ray's dependencies install.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PACKAGE_DIR = Path("splitserve") / "v1"


def proto_files() -> list[str]:
    """The `.proto` files, as paths relative to the include root, sorted."""
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generated_files(out_dir: Path = REPO_ROOT) -> list[Path]:
    """The stub files under `out_dir`, sorted."""
    return sorted((out_dir / PACKAGE_DIR).glob("*_pb2*.py*"))


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compiles every proto into `out_dir/splitserve/v1/`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # dev-only dependency, imported only when generating

    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / f) for f in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_files()}; see its message above")
    return generated_files(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write splitserve/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
