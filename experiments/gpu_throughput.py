"""Throughput on one GPU: a ~1B-parameter random kimi_linear in bf16, and each kernel against torch.

    python -m experiments.gpu_throughput [--device cuda] [--batch-sizes 1,16,64] [--engine-only | --kernels-only]
    python -m experiments.gpu_throughput --device cpu --tiny      # the CPU smoke mode the tests run

Prints three tables:
* engine: prefill and decode tokens/s of the whole engine at each batch size (greedy, EOS
  ignored), decode eager and with CUDA graphs (a second engine; CUDA only), and the faster decode
  against the memory-bandwidth bound: the bytes one decode step must read
  (weights, counting only the experts a batch of that size touches on average, plus the KV rows
  and KDA states of the batch) over the device's measured copy bandwidth. Each engine's load is
  printed with its parts (weights, graphs, the warm-up's kernels: engine/warm_up.py), and each
  batch size's first request (2 tokens) beside the measured ones;
* kernels: paged MLA attention (Triton) and KDA (fla) against their torch references, same inputs,
  with the largest difference, at decode and prefill shapes of the model;
* the MLA prefill kernel at a 32k context under a few tile shapes (block of pairs, of keys, warps):
  the default against the others, for the next GPU session to choose from.
Called by scripts/gpu_check.sh (stages `decode` and `kernels`). Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from experiments.gpu_common import (
    MODEL_1B,
    batch_sizes,
    check_device,
    checkpoint,
    load_engine,
    model_dtype,
    print_table,
    progress,
    stage_parser,
    synchronize,
    timed,
    write_figures,
)
from splitserve.engine.forward_batch import TokenGroup

if TYPE_CHECKING:
    from splitserve import LLM

__all__ = [
    "MODEL_1B",
    "decode_step_bytes",
    "main",
]  # MODEL_1B: experiments/decode_launches.py imports it here
_MLA = "full_attention"
# (pairs per program, keys per tile, warps) of the MLA prefill sweep; the first is the kernel's default
MLA_TILES = [(16, 32, 4), (16, 64, 4), (16, 32, 8), (32, 32, 8), (64, 32, 8)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,16,64; tiny: 1,2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny: 8)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="decode steps (default 64; tiny: 2)")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--engine-only", action="store_true", help="the engine table alone")
    part.add_argument("--kernels-only", action="store_true", help="the kernel tables alone")
    args = parser.parse_args(argv)
    args.batch_sizes = batch_sizes(args.batch_sizes, args.tiny)
    args.prompt_len = args.prompt_len or (8 if args.tiny else 512)
    args.decode_tokens = args.decode_tokens or (2 if args.tiny else 64)
    args.dtype = model_dtype(args.device)
    return args


def measured_bandwidth_bytes_per_s(device: str) -> float:
    """Device copy bandwidth (read + write bytes per second) of a 1 GiB copy (16 MiB on the CPU)."""
    num_bytes = (1 << 30) if device.startswith("cuda") else (16 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device)
    return 2 * num_bytes / seconds


def decode_step_bytes(model: torch.nn.Module, batch: int, context: int) -> int:
    """Bytes one decode step must read: weights (the experts a batch touches on average) and caches."""
    config: Any = model.config
    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    touched = 1.0 - (1.0 - top_k / experts) ** batch
    weight_bytes = 0.0
    for name, param in model.named_parameters():
        size: float = param.numel() * param.element_size()
        if "embed_tokens" in name:
            size = batch * param.shape[-1] * param.element_size()
        elif ".experts." in name and "shared" not in name:
            size *= touched
        weight_bytes += size
    elt = next(model.parameters()).element_size()
    num_mla = sum(t == _MLA for t in config.layer_types)
    num_kda = len(config.layer_types) - num_mla
    kv_bytes = num_mla * batch * context * (config.kv_lora_rank + config.qk_rope_head_dim) * elt
    state_bytes = num_kda * batch * config.linear_num_heads * config.linear_head_dim**2 * 4 * 2  # fp32, r+w
    return int(weight_bytes + kv_bytes + state_bytes)


@dataclasses.dataclass
class EngineRun:
    """One engine's figures: its load (engine/warm_up.py's report), each batch size's first request
    (seconds, 2 tokens) and its speeds: batch -> (prefill tok/s, decode tok/s, bytes a decode step reads)."""

    load: dict[str, Any]
    first_request_s: dict[int, float]
    speeds: dict[int, tuple[float, float, int]]
    graphs: bool


def engine_rows(
    args: argparse.Namespace, path: Path, bandwidth: float
) -> tuple[list[list[str]], dict[str, Any]]:
    """Per batch size: prefill and decode tokens/s eager, decode with CUDA graphs (CUDA only), the
    bound; and the figures of both engines."""
    cuda = args.device.startswith("cuda")
    eager = engine_speeds(args, path, enforce_eager=True)
    graphed = engine_speeds(args, path, enforce_eager=False) if cuda else None
    rows, batches = [], {}
    for batch in args.batch_sizes:
        prefill_tps, decode_tps, step_bytes = eager.speeds[batch]
        bound_tps = batch * bandwidth / step_bytes
        graph_tps = graphed.speeds[batch][1] if graphed is not None and graphed.graphs else None
        best_tps = max(decode_tps, graph_tps or 0.0)
        graph_cells = ["n/a (needs CUDA)" if not cuda else "n/a", ""]
        if graph_tps is not None:
            graph_cells = [f"{graph_tps:,.0f}", f"{graph_tps / decode_tps:.2f}x"]
        rows.append(
            [
                str(batch),
                f"{prefill_tps:,.0f}",
                f"{decode_tps:,.0f}",
                *graph_cells,
                f"{bound_tps:,.0f}",
                f"{100 * best_tps / bound_tps:.0f}%",
            ]
        )
        batches[batch] = {
            "prefill_tok_s": prefill_tps,
            "eager_tok_s": decode_tps,
            "graphs_tok_s": graph_tps,
            "bound_tok_s": bound_tps,
        }
    runs = {"eager": eager, "graphs": graphed}
    figures = {
        "batches": batches,
        "load": {name: run.load for name, run in runs.items() if run is not None},
        "first_request_s": {name: run.first_request_s for name, run in runs.items() if run is not None},
    }
    return rows, figures


def engine_speeds(args: argparse.Namespace, path: Path, enforce_eager: bool) -> EngineRun:
    """One engine's load and speeds; with `enforce_eager` False on CUDA its decode steps replay CUDA
    graphs (printed when they do not)."""
    progress(f"an engine with {'eager decode' if enforce_eager else 'CUDA graphs'}:")
    llm, ready_s = load_engine(
        args,
        path,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(2048, args.prompt_len),
        max_model_len=args.prompt_len + args.decode_tokens + 16,
        enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=tuple(args.batch_sizes),  # only the buckets measured: a shorter capture
    )
    report = llm.engine.warm_up
    model = llm.engine.model
    if enforce_eager:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"model: {num_params / 1e9:.3f}B parameters, {args.dtype}, device {args.device}")
    elif llm.engine.runner.graphs is None:
        print("CUDA graphs: refused or failed to capture (the log says why); no graphs column")
    load = {**dataclasses.asdict(report), "total_s": report.total_s, "ready_s": ready_s}
    run = EngineRun(load, {}, {}, llm.engine.runner.graphs is not None)
    measure_speeds(args, llm, run)
    del llm, model  # the next engine's caches need this one's device memory back
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return run


def measure_speeds(args: argparse.Namespace, llm: LLM, run: EngineRun) -> None:
    """Fill `run` with each batch size's first request and speeds on `llm` (an `LLM`)."""
    from splitserve import SamplingParams

    model = llm.engine.model
    vocab = model.config.vocab_size
    for batch in args.batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()

        def generate(max_tokens: int, prompts: list[list[int]] = prompts) -> float:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            synchronize(args.device)
            start = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
            synchronize(args.device)
            return time.perf_counter() - start

        run.first_request_s[batch] = generate(2)  # what compiles here, the warm-up at load missed
        prefill_s = generate(1)
        total_s = generate(1 + args.decode_tokens)
        progress(
            f"batch {batch}: first request (2 tokens) {run.first_request_s[batch]:.3f} s, prefill {prefill_s:.3f} s, "
            f"prefill + {args.decode_tokens} steps {total_s:.3f} s"
        )
        decode_s = max(total_s - prefill_s, 1e-9)
        context = args.prompt_len + args.decode_tokens // 2
        run.speeds[batch] = (
            batch * args.prompt_len / prefill_s,
            batch * args.decode_tokens / decode_s,
            decode_step_bytes(model, batch, context),
        )


@contextlib.contextmanager
def backend(env: str, value: str) -> Iterator[None]:
    before = os.environ.get(env)
    os.environ[env] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before


def mla_group(batch: int, length: int, context: int, device: str, block_size: int = 16) -> TokenGroup:
    """Rows of `length` new tokens at the end of `context`, blocks scattered through the pool."""
    blocks_per_row = -(-context // block_size)
    table = torch.randperm(batch * blocks_per_row).view(batch, blocks_per_row)
    positions = torch.arange(context)
    kv_index = table[:, positions // block_size] * block_size + positions % block_size
    steps = torch.arange(length)
    query_pos = (context - length + steps).expand(batch, length)
    token_index = torch.arange(batch * length).view(batch, length)
    return TokenGroup(
        token_index=token_index.to(device),
        valid=torch.ones(batch, length, dtype=torch.bool, device=device),
        lengths=[length] * batch,
        state_slots=torch.zeros(batch, dtype=torch.long, device=device),
        kv_index=kv_index.to(device),
        query_pos=query_pos.contiguous().to(device),
    )


def mla_case(
    args: argparse.Namespace, batch: int, length: int, context: int
) -> dict[str, Callable[[], object]]:
    from splitserve.engine.ops.paged_mla import BACKEND_ENV, paged_mla_attention

    heads, rank, rope = (4, 32, 16) if args.tiny else (16, 512, 64)
    dtype = getattr(torch, args.dtype)
    group = mla_group(batch, length, context, args.device)
    pool = torch.randn(batch * -(-context // 16) * 16, rank + rope, device=args.device).to(dtype)
    q = torch.randn(batch * length, heads, rank + rope, device=args.device).to(dtype)
    out = torch.empty(batch * length, heads, rank, dtype=dtype, device=args.device)
    scale = (rope + 128) ** -0.5

    def run(name: str) -> Callable[[], object]:
        def call() -> torch.Tensor:
            with backend(BACKEND_ENV, name):
                paged_mla_attention(q, pool, group, rank, scale, out)
            return out.clone()

        return call

    return {"torch": run("torch"), "kernel": run("triton")}


def kda_case(args: argparse.Namespace, batch: int, length: int) -> dict[str, Callable[[], object]]:
    from splitserve.engine.ops.kda import l2norm
    from splitserve.engine.ops.kda_dispatch import BACKEND_ENV, kda_decode, kda_prefill

    heads, dim = (4, 16) if args.tiny else (16, 128)
    dev = args.device
    q = l2norm(torch.randn(batch, heads, length, dim, device=dev)) * dim**-0.5
    k = l2norm(torch.randn(batch, heads, length, dim, device=dev))
    v = torch.randn(batch, heads, length, dim, device=dev)
    g = -torch.nn.functional.softplus(torch.randn(batch, heads, length, dim, device=dev)) * 0.1
    beta = torch.sigmoid(torch.randn(batch, heads, length, device=dev))
    state = torch.randn(batch, heads, dim, dim, device=dev) * 0.1

    def run(name: str) -> Callable[[], object]:
        def call() -> torch.Tensor:
            with backend(BACKEND_ENV, name):
                if length == 1:
                    out, _ = kda_decode(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
                else:
                    out, _ = kda_prefill(q, k, v, g, beta, state)
            return out.float()

        return call

    return {"torch": run("torch"), "kernel": run("fla")}


def kernel_rows(args: argparse.Namespace) -> list[list[str]]:
    cuda = args.device.startswith("cuda")
    context = 64 if args.tiny else 4096
    chunk = 16 if args.tiny else 2048
    cases: list[tuple[str, dict[str, Callable[[], object]]]] = []
    for batch in args.batch_sizes:
        cases.append((f"MLA decode b={batch} ctx={context}", mla_case(args, batch, 1, context)))
    cases.append((f"MLA prefill b=1 chunk={chunk}", mla_case(args, 1, chunk, chunk)))
    for batch in args.batch_sizes:
        cases.append((f"KDA decode b={batch}", kda_case(args, batch, 1)))
    cases.append((f"KDA prefill b=1 len={chunk}", kda_case(args, 1, chunk)))
    rows = []
    for name, calls in cases:
        torch_s = timed(calls["torch"], args.device, repeats=1 if args.tiny else 5, warmup=1)
        if not cuda:  # Triton and fla need CUDA; the smoke mode times the torch path alone
            rows.append([name, f"{torch_s * 1e3:.3f}", "n/a (needs CUDA)", "", ""])
            continue
        kernel_s = timed(calls["kernel"], args.device)
        diff = (calls["kernel"]() - calls["torch"]()).abs().max().item()  # type: ignore[operator]
        rows.append(
            [
                name,
                f"{torch_s * 1e3:.3f}",
                f"{kernel_s * 1e3:.3f}",
                f"{torch_s / kernel_s:.1f}x",
                f"{diff:.2e}",
            ]
        )
    return rows


def mla_prefill_tiles(args: argparse.Namespace) -> list[list[str]]:
    """The MLA prefill kernel on one chunk at the end of a long context, under each of `MLA_TILES`:
    ms per call and the largest difference from the default tiles (CUDA only)."""
    from splitserve.engine.ops.paged_mla_triton import paged_mla_triton_split

    chunk, context = (16, 64) if args.tiny else (2048, 32768)
    heads, rank, rope = (4, 32, 16) if args.tiny else (16, 512, 64)
    if not args.device.startswith("cuda"):
        return [[f"chunk {chunk} ctx {context}", "n/a (needs CUDA)", "", ""]]
    dtype, dev = getattr(torch, args.dtype), args.device
    group = mla_group(1, chunk, context, dev)
    pool = torch.randn(-(-context // 16) * 16, rank + rope, device=dev).to(dtype)
    q_latent = torch.randn(chunk, heads, rank, device=dev).to(dtype)
    q_rope = torch.randn(chunk, heads, 128 + rope, device=dev).to(dtype)[
        ..., 128:
    ]  # a slice, as in the layer
    scale = (rope + 128) ** -0.5
    rows, want = [], None
    for block_m, block_n, warps in MLA_TILES:
        out = torch.empty(heads, chunk, rank, dtype=dtype, device=dev).transpose(0, 1)

        def call(block_m: int = block_m, block_n: int = block_n, warps: int = warps, out: Any = out) -> None:
            paged_mla_triton_split(
                q_latent, q_rope, pool, group, scale, out, block_m, block_n, num_warps=warps
            )

        name = f"pairs {block_m}, keys {block_n}, warps {warps}"
        try:
            seconds = timed(call, dev, repeats=3, warmup=1)
        except Exception as exc:  # a tile that does not fit the chip's registers or shared memory
            rows.append([name, "failed", type(exc).__name__, str(exc)[:60]])
            continue
        want = out.float() if want is None else want
        diff = (out.float() - want).abs().max().item()
        rows.append([name, f"{seconds * 1e3:.2f}", f"{chunk * context / seconds / 1e9:.1f}", f"{diff:.1e}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_device(args.device)
    torch.manual_seed(0)
    bandwidth = measured_bandwidth_bytes_per_s(args.device)
    print(f"device copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (read + write)")
    figures: dict[str, Any] = {"bandwidth_gb_s": bandwidth / 1e9}
    summary = []
    if not args.kernels_only:
        with tempfile.TemporaryDirectory() as scratch:
            path = checkpoint(args.model_dir, args.tiny, Path(scratch))
            progress(f"checkpoint ready at {path}")
            rows, engine = engine_rows(args, path, bandwidth)
        figures["engine"] = engine
        header = ["batch", "prefill tok/s", "decode tok/s", "graphs tok/s", "graphs/eager"]
        header += ["bandwidth bound tok/s", "of bound"]
        print_table(
            f"engine, prompt {args.prompt_len} tokens, {args.decode_tokens} decode steps", header, rows
        )
        best = {b: max(v["eager_tok_s"], v["graphs_tok_s"] or 0.0) for b, v in engine["batches"].items()}
        summary.append("decode " + ", ".join(f"b{b} {tps:,.0f} tok/s" for b, tps in best.items()))
        summary.append(f"load {engine['load']['eager']['total_s']:.1f} s")
    if not args.engine_only:
        kernels = kernel_rows(args)
        print_table(
            "kernels against their torch reference (ms per call, median)",
            ["case", "torch ms", "kernel ms", "speed-up", "max |diff|"],
            kernels,
        )
        tiles = mla_prefill_tiles(args)
        print_table(
            "MLA prefill kernel, one chunk at the end of a long context, by tile shape",
            ["tiles", "ms", "G query-key pairs/s", "max |diff| vs first"],
            tiles,
        )
        figures["kernels"] = {row[0]: row[1:] for row in kernels}
        figures["mla_prefill_tiles"] = {row[0]: row[1:] for row in tiles}
        summary.append(f"{len(kernels)} kernel cases")
    write_figures(args.json, "; ".join(summary), figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
