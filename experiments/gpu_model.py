"""The device check's checkpoint: the ~1B random kimi_linear in bf16, built once into `--model-dir`.

    python -m experiments.gpu_model --model-dir DIR [--tiny]

Later stages load it from there (scripts/gpu_check.sh passes the same folder to each); a folder that
already holds a checkpoint is reused. Prints its parameters, bytes and the seconds it took.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from experiments.gpu_common import checkpoint, stage_parser, write_figures
from splitserve.tiny_model import num_checkpoint_elements


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    reused = bool(args.model_dir) and (Path(args.model_dir) / "config.json").exists()
    with tempfile.TemporaryDirectory() as scratch:
        start_s = time.perf_counter()
        path = checkpoint(args.model_dir, args.tiny, Path(scratch))
        seconds = time.perf_counter() - start_s
        num_params = num_checkpoint_elements(path)
        num_bytes = (path / "model.safetensors").stat().st_size
    state = "reused" if reused else f"built in {seconds:.1f} s"
    print(f"checkpoint {path}: {num_params / 1e9:.3f}B parameters, {num_bytes / 2**30:.2f} GiB, {state}")
    figures = {"seconds": seconds, "reused": reused, "parameters": num_params, "bytes": num_bytes}
    write_figures(args.json, f"{num_params / 1e9:.2f}B parameters, {state}", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
