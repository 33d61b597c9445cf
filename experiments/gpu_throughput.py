"""Throughput on one GPU: a ~1B-parameter random kimi_linear in bf16, and each kernel against torch.

    python -m experiments.gpu_throughput [--device cuda] [--batch-sizes 1,16,64]
    python -m experiments.gpu_throughput --device cpu --tiny      # the CPU smoke mode the tests run

Prints three tables:
* engine: prefill and decode tokens/s of the whole engine at each batch size (greedy, EOS
  ignored), decode eager and with CUDA graphs (a second engine; CUDA only), and the faster decode
  against the memory-bandwidth bound: the bytes one decode step must read
  (weights, counting only the experts a batch of that size touches on average, plus the KV rows
  and KDA states of the batch) over the device's measured copy bandwidth;
* kernels: paged MLA attention (Triton) and KDA (fla) against their torch references, same inputs,
  with the largest difference, at decode and prefill shapes of the model;
* the parameter count and the measured bandwidth.
Called by scripts/gpu_check.sh. Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitserve.engine.forward_batch import TokenGroup

_START_S = time.perf_counter()


def progress(what: str) -> None:
    """One timestamped line (seconds since start), flushed: a run cut off by a time limit shows
    how far it got and what took the time."""
    print(f"[{time.perf_counter() - _START_S:7.1f} s] {what}", flush=True)

if TYPE_CHECKING:
    from splitserve import LLM

_KDA, _MLA = "linear_attention", "full_attention"
# ~1.0B parameters (printed at run time): 12 layers, 9 KDA + 3 MLA, Kimi-Linear-48B's head shapes
# (KDA 16 x 128, MLA rank 512 / rope 64 / nope 128 / v 128), 16 routed experts top-2 + 1 shared.
MODEL_1B: dict[str, object] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 640,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "linear_num_heads": 16,
    "linear_head_dim": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "layer_types": [_KDA, _KDA, _KDA, _MLA] * 3,
    "mlp_layer_types": ["dense"] + ["sparse"] * 11,
    "max_position_embeddings": 65536,  # room for the 32k-token prompt of scripts/gpu_check.sh
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset and small shapes (smoke test)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,16,64; tiny: 1,2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny: 8)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="decode steps (default 64; tiny: 2)")
    parser.add_argument("--model-dir", default=None, help="reuse/keep the random checkpoint here")
    parser.add_argument(
        "--engine-only", action="store_true", help="eager engine speeds only: no CUDA graphs, no kernel table"
    )
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if args.tiny else "1,16,64")).split(",")]
    args.prompt_len = args.prompt_len or (8 if args.tiny else 512)
    args.decode_tokens = args.decode_tokens or (2 if args.tiny else 64)
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    return args


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of `fn` after `warmup` calls (compiles, autotunes)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_checkpoint(args: argparse.Namespace, where: Path) -> Path:
    from splitserve.tiny_model import make_tiny_model

    if (where / "config.json").exists():
        return where
    if args.tiny:
        return make_tiny_model(where, preset="tiny", seed=0)
    return make_tiny_model(where, preset="bench-10m", seed=0, **MODEL_1B)


def measured_bandwidth_bytes_per_s(device: str) -> float:
    """Device copy bandwidth (read + write bytes per second) of a 1 GiB copy (16 MiB on the CPU)."""
    num_bytes = (1 << 30) if device.startswith("cuda") else (16 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device)
    return 2 * num_bytes / seconds


def decode_step_bytes(model: torch.nn.Module, batch: int, context: int) -> int:
    """Bytes one decode step must read: weights (the experts a batch touches on average) and caches."""
    config = model.config
    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    touched = 1.0 - (1.0 - top_k / experts) ** batch
    weight_bytes = 0.0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
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


def engine_rows(args: argparse.Namespace, path: Path, bandwidth: float) -> list[list[str]]:
    """Per batch size: prefill and decode tokens/s eager, decode with CUDA graphs (CUDA only), the bound."""
    eager = engine_speeds(args, path, enforce_eager=True)
    cuda = args.device.startswith("cuda")
    graphed = engine_speeds(args, path, enforce_eager=False) if cuda and not args.engine_only else {}
    rows = []
    for batch in args.batch_sizes:
        prefill_tps, decode_tps, step_bytes = eager[batch]
        bound_tps = batch * bandwidth / step_bytes
        best_tps = decode_tps
        if batch in graphed:
            graph_tps = graphed[batch][1]
            best_tps = max(decode_tps, graph_tps)
            graph_cells = [f"{graph_tps:,.0f}", f"{graph_tps / decode_tps:.2f}x"]
        else:
            graph_cells = ["n/a", ""] if cuda else ["n/a (needs CUDA)", ""]
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
    return rows


def engine_speeds(
    args: argparse.Namespace, path: Path, enforce_eager: bool
) -> dict[int, tuple[float, float, int]]:
    """batch -> (prefill tok/s, decode tok/s, bytes a decode step reads) of one engine; with
    `enforce_eager` False on CUDA its decode steps replay CUDA graphs (printed when they do not)."""
    from splitserve import LLM

    llm = LLM(
        model=str(path),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(2048, args.prompt_len),
        max_model_len=args.prompt_len + args.decode_tokens + 16,
        enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=tuple(args.batch_sizes),  # only the buckets measured: a shorter capture
    )
    progress(f"engine loaded ({'eager' if enforce_eager else 'CUDA graphs'})")
    model = llm.engine.model
    if enforce_eager:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"model: {num_params / 1e9:.3f}B parameters, {args.dtype}, device {args.device}")
    elif llm.engine.runner.graphs is None:
        print("CUDA graphs: refused or failed to capture (the log says why); the graphs column is eager")
    speeds = measure_speeds(args, llm)
    del llm, model  # the next engine's caches need this one's device memory back
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return speeds


def measure_speeds(args: argparse.Namespace, llm: LLM) -> dict[int, tuple[float, float, int]]:
    """batch -> (prefill tok/s, decode tok/s, bytes a decode step reads) of `llm` (an `LLM`)."""
    from splitserve import SamplingParams

    model = llm.engine.model
    vocab = model.config.vocab_size
    speeds = {}
    for batch in args.batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()

        def run(max_tokens: int, prompts: list[list[int]] = prompts) -> float:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            synchronize(args.device)
            start = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
            synchronize(args.device)
            return time.perf_counter() - start

        warmup_s = run(2)  # warm-up at this batch size: kernel compiles and autotuning
        progress(f"batch {batch}: warm-up (2 tokens) took {warmup_s:.1f} s")
        prefill_s = run(1)
        total_s = run(1 + args.decode_tokens)
        progress(f"batch {batch}: prefill {prefill_s:.3f} s, prefill + {args.decode_tokens} steps {total_s:.3f} s")
        decode_s = max(total_s - prefill_s, 1e-9)
        context = args.prompt_len + args.decode_tokens // 2
        speeds[batch] = (
            batch * args.prompt_len / prefill_s,
            batch * args.decode_tokens / decode_s,
            decode_step_bytes(model, batch, context),
        )
    return speeds


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


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda but torch sees no CUDA device: use a CUDA build of torch, or --device cpu"
        )
    torch.manual_seed(0)
    bandwidth = measured_bandwidth_bytes_per_s(args.device)
    print(f"device copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (read + write)")
    with contextlib.ExitStack() as stack:
        where = (
            Path(args.model_dir)
            if args.model_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        path = build_checkpoint(args, where)
        progress(f"checkpoint ready at {path}")
        engine = engine_rows(args, path, bandwidth)
    print_table(
        f"engine, prompt {args.prompt_len} tokens, {args.decode_tokens} decode steps",
        [
            "batch",
            "prefill tok/s",
            "decode tok/s",
            "graphs tok/s",
            "graphs/eager",
            "bandwidth bound tok/s",
            "of bound",
        ],
        engine,
    )
    if not args.engine_only:
        print_table(
            "kernels against their torch reference (ms per call, median)",
            ["case", "torch ms", "kernel ms", "speed-up", "max |diff|"],
            kernel_rows(args),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
