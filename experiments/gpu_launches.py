"""Kernel launches per decode step and per prefill chunk on the CUDA code path, counted on the CPU.

    python -m experiments.gpu_launches [--batch-sizes 1,64] [--tiny]

The device check's first stage (scripts/gpu_check.sh `launches`): it needs no GPU, so a machine that
has one spends seconds on it. Prints experiments/decode_launches.py's report per batch size (launches
per step, per layer, by module) and experiments/prefill_launches.py's count of a 2,048-token chunk at
the start of a prompt and 30k tokens into it, with the largest grid each asked for.
"""

from __future__ import annotations

import argparse

from experiments import decode_launches, prefill_launches
from experiments.gpu_common import write_figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (smoke test)")
    parser.add_argument("--json", default=None, help="write the stage's figures here (one JSON object)")
    args, _ = parser.parse_known_args(
        argv
    )  # the stages' other arguments (--device, --model-dir) mean nothing here
    config = decode_launches.model_config("tiny" if args.tiny else "1b")
    decode = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        step = decode_launches.count_decode_step(config, batch)
        print(decode_launches.report(step))
        decode[batch] = {"launches": step.total, "most_in_a_layer": max(step.per_layer())}
    chunk = 64 if args.tiny else 2048
    prefill = {}
    for context in (0, 30 * chunk // 2):
        step = prefill_launches.count_prefill_chunk(config, context, chunk)
        grid = prefill_launches.largest_grid(step)
        print(
            f"prefill chunk of {chunk:,} tokens after {context:,}: {step.total:,} launches, largest grid {grid}"
        )
        prefill[context] = {"launches": step.total, "largest_grid": grid}
    summary = "decode " + "/".join(str(d["launches"]) for d in decode.values())
    summary += f" launches (batch {args.batch_sizes}), a prefill chunk " + "/".join(
        str(p["launches"]) for p in prefill.values()
    )
    write_figures(args.json, summary, {"decode": decode, "prefill_chunk": chunk, "prefill": prefill})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
