"""What the device check's stages share (scripts/gpu_check.sh): the ~1B model, its checkpoint, timing,
progress lines, tables, and each stage's figures as one JSON object.

Every stage module takes `--device` (cuda, or cpu for the smoke mode the tests run), `--tiny` (the
tiny preset and small shapes), `--model-dir` (the checkpoint, built there once and reused by later
stages) and `--json PATH` (where its figures go; the script folds them into the stage's line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_START_S = time.perf_counter()
_KDA, _MLA = "linear_attention", "full_attention"
# ~1.0B parameters (printed at run time): 12 layers, 9 KDA + 3 MLA, Kimi-Linear-48B's head shapes
# (KDA 16 x 128, MLA rank 512 / rope 64 / nope 128 / v 128), 16 routed experts top-2 + 1 shared.
MODEL_1B: dict[str, Any] = {
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
    "max_position_embeddings": 135_168,  # room for the 128k-token prompt of scripts/gpu_check.sh
}


def progress(what: str) -> None:
    """One timestamped line (seconds since start), flushed: a run cut off by a time limit shows
    how far it got and what took the time."""
    print(f"[{time.perf_counter() - _START_S:7.1f} s] {what}", flush=True)


def stage_parser(doc: str) -> argparse.ArgumentParser:
    """A stage module's parser (described by its doc's first line) with the arguments every stage takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    stage_args(parser)
    return parser


def stage_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every stage module takes (see the module doc)."""
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the smoke mode)")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset and small shapes (smoke test)")
    parser.add_argument(
        "--model-dir", default=None, help="the checkpoint: built here if missing, then reused"
    )
    parser.add_argument("--json", default=None, help="write the stage's figures here (one JSON object)")


def batch_sizes(value: str | None, tiny: bool) -> list[int]:
    """`--batch-sizes` (comma-separated), by default 1, 16, 64 (tiny: 1, 2)."""
    return [int(b) for b in (value or ("1,2" if tiny else "1,16,64")).split(",")]


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda but torch sees no CUDA device: use a CUDA build of torch, or --device cpu"
        )


def model_dtype(device: str) -> str:
    return "float32" if device == "cpu" else "bfloat16"


def synchronize(device: str | torch.device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of `fn` after `warmup` calls."""
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


def checkpoint(model_dir: str | None, tiny: bool, scratch: Path) -> Path:
    """The stage's checkpoint: `model_dir` when it holds one, else built there (or in `scratch`)."""
    where = Path(model_dir) if model_dir else scratch
    if (where / "config.json").exists():
        return where
    start_s = time.perf_counter()
    if tiny:
        from splitserve.tiny_model import make_tiny_model

        make_tiny_model(
            where, preset="tiny", seed=0, max_position_embeddings=MODEL_1B["max_position_embeddings"]
        )
    else:
        build_1b_checkpoint(where)
    progress(f"checkpoint built at {where} in {time.perf_counter() - start_s:.1f} s")
    return where


def build_1b_checkpoint(where: Path, seed: int = 0) -> Path:
    """The ~1B random kimi_linear checkpoint in bf16 (2 bytes a parameter on disk). Built without
    transformers' initialisation (the model is made on the meta device, then every tensor drawn once
    by `randomize_weights`, as `make_tiny_model` draws them): ~20 s instead of a minute or more."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from splitserve.tiny_model import PRESETS, randomize_weights
    from splitserve.tokenizer_files import special_token_ids, write_tokenizer_files

    tokenizer = write_tokenizer_files(where, model_max_length=int(MODEL_1B["max_position_embeddings"]))
    kwargs: dict[str, Any] = {**PRESETS["bench-10m"], **MODEL_1B, **special_token_ids(tokenizer)}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    config = KimiLinearConfig(vocab_size=tokenizer.get_vocab_size(), dtype="bfloat16", **kwargs)
    with torch.device("meta"):
        model: Any = KimiLinearForCausalLM(config)
    model.to_empty(device="cpu")
    randomize_weights(model, seed=seed)
    model.to(torch.bfloat16).save_pretrained(where)
    return where


def load_engine(args: argparse.Namespace, path: Path, **engine_kwargs: Any) -> tuple[Any, float]:
    """`splitserve.LLM` on the stage's device and dtype, with `engine_kwargs` (EngineConfig fields), and
    the seconds it took to be ready; prints them with the load's parts (engine/warm_up.py)."""
    from splitserve import LLM

    start_s = time.perf_counter()
    llm = LLM(model=str(path), dtype=args.dtype, device=args.device, **engine_kwargs)
    seconds = time.perf_counter() - start_s
    progress(f"engine loaded {seconds:.1f} s after it was asked for: {llm.engine.warm_up.log_line()}")
    return llm, seconds


def write_figures(path: str | None, summary: str, figures: dict[str, Any]) -> None:
    """The stage's figures as one JSON object at `path` (nothing without one); `summary` is the short
    line the script's closing table shows for the stage."""
    print(f"summary: {summary}", flush=True)
    if path:
        Path(path).write_text(json.dumps({"summary": summary, "figures": figures}, default=str) + "\n")


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


class CudaTimer:
    """Intervals on the device's stream (CUDA events: recorded without a sync, read once at the end)
    or, on a CPU, on the host clock; `mark()` starts one, `stop()` ends it, `seconds()` lists them."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self._spans: list[tuple[Any, Any]] = []
        self._open: Any = None

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self._open = self._now()

    def stop(self) -> None:
        self._spans.append((self._open, self._now()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in self._spans]
        return [end - start for start, end in self._spans]
