"""The device check's parts that run without a device: the script parses, the throughput
experiment runs end to end in its CPU smoke mode and prints its tables."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from experiments import gpu_throughput

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_parses_and_runs_the_gpu_tests_and_the_experiment():
    script = REPO_ROOT / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text(encoding="utf-8")
    assert "-m gpu" in text and "experiments.gpu_throughput --device cuda" in text


def test_throughput_experiment_smoke_mode_on_cpu(capsys):
    assert gpu_throughput.main(["--device", "cpu", "--tiny", "--batch-sizes", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "prefill tok/s" in out and "bandwidth bound tok/s" in out
    engine_lines = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert [cells[0] for cells in engine_lines] == ["1", "2"]
    assert all(float(cells[1].replace(",", "")) > 0 for cells in engine_lines)  # prefill tok/s measured
    for case in ("MLA decode b=1", "MLA prefill", "KDA decode b=2", "KDA prefill"):
        assert case in out


def test_decode_bound_counts_weights_and_caches():
    torch = pytest.importorskip("torch")

    class Config:
        num_local_experts, num_experts_per_tok = 4, 1
        layer_types = ["linear_attention", "full_attention"]
        kv_lora_rank, qk_rope_head_dim, linear_num_heads, linear_head_dim = 8, 4, 2, 4

    model = torch.nn.Module()
    model.config = Config()  # type: ignore[assignment]
    model.dense = torch.nn.Linear(10, 10, bias=False)  # 100 fp32 = 400 bytes, always read
    batch, context = 1, 5
    kv = 1 * batch * context * (8 + 4) * 4
    state = 1 * batch * 2 * 4 * 4 * 4 * 2
    assert gpu_throughput.decode_step_bytes(model, batch, context) == 400 + kv + state
