"""Regenerates the checked-in Python for every `.proto` in this folder: `python -m proto.generate`.

Protos are compiled from the repository root as `proto/<name>.proto`, so the generated modules
import each other as `from proto import common_pb2` and load as `proto.<name>_pb2`.
`--out DIR` writes under `DIR/proto/` instead (the sync test compares the two).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent


def proto_files() -> list[str]:
    """The `.proto` files, as paths relative to the repository root, sorted."""
    return sorted(f"{PROTO_DIR.name}/{p.name}" for p in PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compiles every proto into `out_dir/proto/`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # dev-only dependency, imported only when generating

    (out_dir / PROTO_DIR.name).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO_ROOT / f) for f in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_files()}; see its message above")
    return sorted((out_dir / PROTO_DIR.name).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write proto/*_pb2*.py under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
