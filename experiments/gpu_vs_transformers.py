"""Side by side on one GPU: transformers' `generate` and the engine, same model, same prompts, one process.

    python -m experiments.gpu_vs_transformers [--batch-sizes 1,16,64] [--prompt-len 256] [--new-tokens 32]
    python -m experiments.gpu_vs_transformers --device cpu --tiny     # the CPU smoke mode the tests run

The ~1B random kimi_linear in bf16 runs first in transformers' `KimiLinearForCausalLM.generate` (greedy,
every prompt of the batch the same length, so no padding; with flash-linear-attention installed it
takes fla's KDA kernels, as a transformers user would get), then in the engine (`splitserve.LLM`, CUDA
graphs on), each after a first call that compiles and tunes what it needs. Printed per batch size:
each side's seconds and output tokens per second (prefill included), the engine's speed-up, and how
many requests gave the same greedy tokens (bf16: a near tie may flip one). Figures only.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from experiments.gpu_common import (
    batch_sizes,
    check_device,
    checkpoint,
    load_engine,
    model_dtype,
    print_table,
    progress,
    stage_parser,
    synchronize,
    write_figures,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,16,64; tiny: 1,2)")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="tokens per prompt (default 256; tiny: 8)"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default 32; tiny: 3)")
    args = parser.parse_args(argv)
    args.batch_sizes = batch_sizes(args.batch_sizes, args.tiny)
    args.prompt_len = args.prompt_len or (8 if args.tiny else 256)
    args.new_tokens = args.new_tokens or (3 if args.tiny else 32)
    args.dtype = model_dtype(args.device)
    return args


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def wall(fn: Any, device: str) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def hf_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy `generate` of exactly `new_tokens` per prompt (EOS ignored)."""
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.config.pad_token_id or 0,
        )


def run_transformers(path: Path, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Per batch size: the first generate's seconds, the measured one's, and its tokens."""
    from transformers import KimiLinearForCausalLM

    model: Any = KimiLinearForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    results = {}
    for batch in args.batch_sizes:
        ids = torch.tensor(prompts_for(batch, args.prompt_len, model.config.vocab_size), device=args.device)
        first_s, _ = wall(lambda ids=ids: hf_generate(model, ids, 2), args.device)
        seconds, out = wall(lambda ids=ids: hf_generate(model, ids, args.new_tokens), args.device)
        results[batch] = {
            "first_s": first_s,
            "seconds": seconds,
            "tokens": out[:, args.prompt_len :].tolist(),
        }
        progress(f"transformers, batch {batch}: {seconds:.2f} s (first call {first_s:.1f} s)")
    model = None  # the engine's caches need its device memory back
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def run_engine(path: Path, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    from splitserve import SamplingParams

    llm, _ = load_engine(
        args,
        path,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(2048, args.prompt_len),
        max_model_len=args.prompt_len + args.new_tokens + 16,
    )
    vocab = llm.engine.model_config.vocab_size
    results = {}
    for batch in args.batch_sizes:
        prompts = prompts_for(batch, args.prompt_len, vocab)

        def generate(new: int, prompts: list[list[int]] = prompts) -> list[list[int]]:
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            return [o.outputs[0].token_ids for o in outs]

        first_s, _ = wall(lambda: generate(2), args.device)
        seconds, tokens = wall(lambda: generate(args.new_tokens), args.device)
        results[batch] = {"first_s": first_s, "seconds": seconds, "tokens": tokens}
        progress(f"engine, batch {batch}: {seconds:.2f} s (first call {first_s:.2f} s)")
    return results


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    check_device(args.device)
    fla = importlib.util.find_spec("fla") is not None
    print(f"transformers {transformers.__version__}; flash-linear-attention installed: {fla}; {args.dtype}")
    with tempfile.TemporaryDirectory() as scratch:
        path = checkpoint(args.model_dir, args.tiny, Path(scratch))
        hf = run_transformers(path, args)
        engine = run_engine(path, args)
    rows, figures = [], {}
    for batch in args.batch_sizes:
        num_tokens = batch * args.new_tokens
        hf_tps, engine_tps = num_tokens / hf[batch]["seconds"], num_tokens / engine[batch]["seconds"]
        same = sum(a == b for a, b in zip(hf[batch]["tokens"], engine[batch]["tokens"]))
        rows.append(
            [
                str(batch),
                f"{hf[batch]['seconds']:.2f}",
                f"{hf_tps:,.0f}",
                f"{engine[batch]['seconds']:.2f}",
                f"{engine_tps:,.0f}",
                f"{engine_tps / hf_tps:.1f}x",
                f"{same}/{batch}",
            ]
        )
        figures[batch] = {
            "transformers_s": hf[batch]["seconds"],
            "transformers_first_s": hf[batch]["first_s"],
            "engine_s": engine[batch]["seconds"],
            "engine_first_s": engine[batch]["first_s"],
            "transformers_tok_s": hf_tps,
            "engine_tok_s": engine_tps,
            "ratio": engine_tps / hf_tps,
            "same_tokens": same,
        }
    print_table(
        f"generate, prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy",
        ["batch", "transformers s", "tok/s", "engine s", "tok/s", "engine / transformers", "same tokens"],
        rows,
    )
    summary = "engine / transformers " + ", ".join(f"b{b} {f['ratio']:.1f}x" for b, f in figures.items())
    write_figures(
        args.json, summary, {"fla": fla, "transformers": transformers.__version__, "batches": figures}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
