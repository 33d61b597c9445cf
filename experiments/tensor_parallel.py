"""Tensor and expert parallelism: what a step sends between ranks (arithmetic) and what it costs here (CPU).

    python -m experiments.tensor_parallel [--model 48b|PATH] [--sizes 1,2,4,8,16] [--decode-batch 64]
        [--measure] [--preset bench-10m] [--prompts 8] [--prompt-tokens 256] [--max-tokens 32] [--repeats 3]

Arithmetic (`engine/parallel/layout.py`, from config.json alone): per tensor-parallel size, the
all-reduces per step and their bytes per token (each sublayer's partial sums and the vocabulary-
parallel embedding; a ring all-reduce moves 2 (N - 1) / N of that per rank), the logits gathered on
rank 0 per sampled row, and per decode step of `--decode-batch` rows. Expert parallelism adds nothing
to it (every rank holds every token; the experts' outputs ride in the MoE sublayer's all-reduce); the
last column is what dispatch + combine by all-to-all would move per token instead, had attention
been data parallel (not built).

`--measure`: the offline engine on this machine at TP 1 (torch's threads: every core), TP 1 on one
thread, TP 2 and TP 2 with expert parallelism (a rank gets cores / 2 threads), on the `--preset`
tiny model (fp32, built in a temp folder), all started first and run in rotation: seconds to start,
prefill tokens/s (`--prompts` prompts of `--prompt-tokens`, one token each) and decode tokens/s (the
same prompts, `--max-tokens` more, less the prefill), the median of `--repeats`, and whether the
greedy tokens equal TP 1's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.parallel.layout import check_splits, step_traffic
from splitserve.memory_plan import human_bytes

MODEL_48B = Path(__file__).resolve().parents[1] / "deploy/configs/models/Kimi-Linear-48B-A3B-Instruct"


def traffic_table(model: KimiLinearModelConfig, dtype: str, sizes: list[int], decode_batch: int) -> str:
    rows = [
        (
            "ranks",
            "all-reduces/step",
            "payload/token",
            "ring/rank/token",
            f"rank 0 receives per decode step of {decode_batch}",
            "logits/row",
            "all-to-all/token",
        )
    ]
    for n in sizes:
        try:
            check_splits(model, n, expert_parallel=False)
        except ValueError as exc:
            rows.append((str(n), f"does not split: {exc}", "", "", "", "", ""))
            continue
        t = step_traffic(model, dtype, n)
        step = decode_batch * t.allreduce_ring_bytes_per_token + decode_batch * t.logits_gather_bytes_per_row
        rows.append(
            (
                str(n),
                str(t.num_allreduces),
                human_bytes(t.allreduce_payload_bytes_per_token),
                human_bytes(t.allreduce_ring_bytes_per_token),
                human_bytes(step),
                human_bytes(t.logits_gather_bytes_per_row),
                human_bytes(t.all_to_all_bytes_per_token),
            )
        )
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(rows[0]))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


SETTINGS = (  # (name, tensor_parallel_size, expert_parallel, num_threads per rank: None = cores / ranks)
    ("TP 1", 1, False, None),
    ("TP 1, 1 thread", 1, False, 1),
    ("TP 2", 2, False, None),
    ("TP 2 + EP", 2, True, None),
)


def measure(args: argparse.Namespace) -> None:
    from splitserve import LLM, SamplingParams
    from splitserve.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as where:
        path = make_tiny_model(where, preset=args.preset, seed=0)
        vocab = KimiLinearModelConfig.from_pretrained(path).vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        decode = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engines, start_s = {}, {}
        try:
            for name, size, ep, threads in SETTINGS:
                t0 = time.perf_counter()
                engines[name] = LLM(
                    model=str(path),
                    dtype="float32",
                    max_model_len=1024,
                    tensor_parallel_size=size,
                    expert_parallel=ep,
                    num_threads=threads,
                )
                start_s[name] = time.perf_counter() - t0
            prefill_s: dict[str, list[float]] = {n: [] for n in engines}
            total_s: dict[str, list[float]] = {n: [] for n in engines}
            tokens = {}
            names = list(engines)
            for repeat in range(args.repeats):  # rotated, so a busy machine's drift falls on every setting
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    llm = engines[name]
                    t0 = time.perf_counter()
                    llm.generate(prompt_token_ids=prompts, sampling_params=prefill)
                    prefill_s[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    outs = llm.generate(prompt_token_ids=prompts, sampling_params=decode)
                    total_s[name].append(time.perf_counter() - t0)
                    tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            for llm in engines.values():
                llm.shutdown()
        print(
            f"\n{args.preset}, fp32, {args.prompts} prompts x {args.prompt_tokens} tokens, {args.max_tokens} new"
        )
        print("setting           start_s  prefill tok/s  decode tok/s  tokens = TP 1")
        for name in engines:
            p, d = statistics.median(prefill_s[name]), statistics.median(total_s[name])
            prefill_rate = args.prompts * args.prompt_tokens / p
            decode_rate = args.prompts * (args.max_tokens - 1) / max(d - p, 1e-9)  # the run less its prefill
            same = tokens[name] == tokens["TP 1"]
            print(f"{name:<17} {start_s[name]:7.1f}  {prefill_rate:13,.0f}  {decode_rate:12,.1f}  {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="48b", help="48b, or a checkpoint folder / config.json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--preset", default="bench-10m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = MODEL_48B if args.model == "48b" else Path(args.model)
    model = KimiLinearModelConfig.from_pretrained(folder if folder.is_dir() else folder.parent)
    print(f"{folder.name}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, {args.dtype}")
    print(traffic_table(model, args.dtype, [int(s) for s in args.sizes.split(",")], args.decode_batch))
    if args.measure:
        measure(args)


if __name__ == "__main__":
    main()
