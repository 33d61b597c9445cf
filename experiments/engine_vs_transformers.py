"""Benchmark: splitserve's engine against transformers' batched `generate`, same model, same workload.

    python -m experiments.engine_vs_transformers [--num-prompts 64] [--hf-batch-size 16]

Builds the ~10M-parameter `bench-10m` tiny checkpoint (random weights), draws a mixed workload
(prompt lengths 16-256, output lengths 16-96, from a seed), runs both sides greedily with EOS
ignored, and prints useful output tokens per second (the tokens each request asked for; the
padding transformers generates past a request's own length does not count) and their ratio,
by wall time and by the process's CPU time (on a machine shared with other jobs the CPU time
moves much less than the wall time; with `--threads 1` it is the work done). Then it profiles the engine's decode steps: model compute against scheduling, batch building,
sampling and bookkeeping. Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def workload(num_prompts: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(num_prompts)]
    outputs = [rng.randint(16, 96) for _ in range(num_prompts)]
    return prompts, outputs


def run_engine(
    path: Path, prompts: list[list[int]], outputs: list[int], max_num_seqs: int
) -> tuple[float, float]:
    """Wall and CPU seconds of the engine's `generate` over the whole workload (after a warm-up)."""
    from splitserve import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    print(f"parameters: {sum(p.numel() for p in llm.engine.model.parameters()) / 1e6:.1f}M")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params[:2])  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(outputs)
    return elapsed, cpu


def run_transformers(
    path: Path, prompts: list[list[int]], outputs: list[int], batch_size: int
) -> tuple[float, float]:
    """Wall and CPU seconds of transformers' `generate`, `batch_size` prompts at a time."""
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch, wants = prompts[i : i + batch_size], outputs[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(wants),
                min_new_tokens=max(wants),
                pad_token_id=pad,
            )
    return time.perf_counter() - start, time.process_time() - cpu_start


def module_timers(model: torch.nn.Module) -> tuple[dict[str, float], list[Any]]:
    """Accumulate the wall time of each kind of sub-layer (forward hooks); returns times and handles.

    Top-level kinds (attention by type, MoE block, dense MLP) partition a layer's work apart from
    its norms and residual adds; the indented MoE parts are inside the MoE block's time.
    """
    from splitserve.engine.model.kda import KimiDeltaAttention

    kinds = {
        ".self_attn": lambda m: "KDA attention" if isinstance(m, KimiDeltaAttention) else "MLA attention",
        ".block_sparse_moe": lambda m: "MoE block" if hasattr(m, "experts") else "dense MLP",
        ".block_sparse_moe.gate": lambda m: "  router",
        ".block_sparse_moe.experts": lambda m: "  routed experts",
        ".block_sparse_moe.shared_experts": lambda m: "  shared experts",
    }
    times: dict[str, float] = {}
    handles: list[Any] = []
    for name, module in model.named_modules():
        suffix = next((s for s in kinds if name.endswith(s) and name.count(".") == s.count(".") + 2), None)
        if suffix is None:
            continue
        kind = kinds[suffix](module)
        times.setdefault(kind, 0.0)
        started: list[float] = []

        def pre(_m: Any, _a: Any, started: list[float] = started) -> None:
            started.append(time.perf_counter())

        def post(_m: Any, _a: Any, _o: Any, started: list[float] = started, kind: str = kind) -> None:
            times[kind] += time.perf_counter() - started.pop()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return times, handles


def profile_decode(
    path: Path, prompts: list[list[int]], max_num_seqs: int, steps: int = 40
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per decode step with `max_num_seqs` requests decoding: by phase, and the model
    phase by kind of sub-layer (timed in the same steps; the hooks add a little to "model")."""
    from splitserve import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_num_seqs=max_num_seqs)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts[:max_num_seqs]):
        engine.add_request(f"p{i}", p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    phases = dict.fromkeys(("schedule", "build_batch", "model", "sample", "postprocess"), 0.0)
    runner, model = engine.runner, engine.model
    layer_times, handles = module_timers(model)
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            out = engine.scheduler.schedule()
            t1 = time.perf_counter()
            singles = [s for s in out.scheduled if s.num_new_tokens == 1]
            batch = runner.build_batch(singles, [s for s in out.scheduled if s.num_new_tokens > 1])
            t2 = time.perf_counter()
            logits = model.compute_logits(model(batch, engine.caches))
            t3 = time.perf_counter()
            from splitserve.engine.sampler import SamplingRow

            rows = [
                SamplingRow(s.request.params, s.request.prompt_token_ids, s.request.output_token_ids)
                for s in singles
            ]
            tokens = engine.sampler(logits, rows).token_ids
            t4 = time.perf_counter()
            engine.scheduler.postprocess(out, {s.request.request_id: t for s, t in zip(singles, tokens)})
            t5 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases[key] += dt / steps
    for handle in handles:
        handle.remove()
    return phases, {kind: total / steps for kind, total in layer_times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: build bench-10m)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from splitserve.engine.model_config import KimiLinearModelConfig
    from splitserve.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny_model(Path(tmp) / "bench-10m", preset="bench-10m", seed=args.seed)
        config = KimiLinearModelConfig.from_pretrained(path)
        prompts, outputs = workload(args.num_prompts, config.vocab_size, args.seed)
        useful = sum(outputs)
        print(
            f"model {path} | {args.num_prompts} prompts, {sum(map(len, prompts))} prompt tokens, "
            f"{useful} useful output tokens | torch threads {torch.get_num_threads()}"
        )
        engine_s, engine_cpu = run_engine(path, prompts, outputs, args.max_num_seqs)
        print(
            f"splitserve engine        : {engine_s:8.2f} s  {useful / engine_s:9.1f} useful tok/s"
            f"  (CPU {engine_cpu:.2f} s)",
            flush=True,
        )
        hf_s, hf_cpu = run_transformers(path, prompts, outputs, args.hf_batch_size)
        print(
            f"transformers generate b={args.hf_batch_size:<3}: {hf_s:8.2f} s  {useful / hf_s:9.1f} useful tok/s"
            f"  (CPU {hf_cpu:.2f} s)"
        )
        print(
            f"ratio (engine / transformers): {hf_s / engine_s:.2f}x wall, {hf_cpu / engine_cpu:.2f}x CPU time"
        )
        phases, layers = profile_decode(path, prompts, min(args.max_num_seqs, len(prompts)))
        total = sum(phases.values())
        print(f"decode step with {min(args.max_num_seqs, len(prompts))} running: {total * 1e3:.2f} ms")
        for key, dt in phases.items():
            print(f"  {key:12s} {dt * 1e3:7.2f} ms  {100 * dt / total:5.1f}%")
        top_level = sum(dt for kind, dt in layers.items() if not kind.startswith(" "))
        layers["norms, residuals, embedding, lm head"] = phases["model"] - top_level
        print("model phase by sub-layer kind (summed over layers):")
        for kind, dt in layers.items():
            print(f"  {kind:38s} {dt * 1e3:7.2f} ms  {100 * dt / phases['model']:5.1f}%")


if __name__ == "__main__":
    main()
