"""Run as `python -m tests.engine.load_probe CHECKPOINT OUT`: builds a bf16 engine in this fresh
process and reports, as JSON on stdout, its peak RSS while loading and its RSS after imports,
the parameter dtypes it ended with, and (saved to OUT) its prompt logits.

The peak is the kernel's VmHWM, reset after imports. Not `getrusage().ru_maxrss`: a process
that Python's subprocess starts (vfork, then exec) inherits the parent's peak there, so a test
that built a big model before starting this probe would read its own peak back.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig

PROMPT = list(range(5, 70))
CACHE_BYTES = 4 * 2**20  # small, so the caches allocated after loading stay below the load's peak


def status_bytes(field: str) -> int:
    """A size from /proc/self/status (`VmRSS`, `VmHWM`: the resident set now, and its peak)."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert match is not None, f"no {field} in /proc/self/status"
    return int(match.group(1)) * 1024


def main(path: str, out: str) -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to VmRSS: the peak from here on is the load's
    baseline_bytes = status_bytes("VmRSS")
    engine = LLMEngine(
        EngineConfig(
            model=path,
            dtype="bfloat16",
            max_num_seqs=1,
            max_model_len=128,
            kv_cache_memory_bytes=CACHE_BYTES,
        )
    )
    peak_bytes = status_bytes("VmHWM")
    dtypes = Counter(str(p.dtype) for p in engine.model.parameters())
    fp32_names = [n for n, p in engine.model.named_parameters() if p.dtype == torch.float32]
    torch.save(engine.prompt_logits(PROMPT), out)
    report = {
        "baseline_bytes": baseline_bytes,
        "peak_bytes": peak_bytes,
        "dtypes": dict(dtypes),
        "fp32_names": fp32_names,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
