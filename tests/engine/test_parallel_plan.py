"""`splitserve config plan` per rank, from config.json alone: Kimi-Linear-48B at tensor parallel 2 and a
~1T-parameter MoE of its shape at expert parallel 16 (two 8-GPU nodes), with what a step sends
between the ranks; a layout the ranks cannot split is refused naming the size; no torch is imported."""

from __future__ import annotations

import json
from pathlib import Path

from cli.main import main
from splitserve.config import load_config
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.memory_plan import plan_cluster
from tests.python_process import run_python

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "configs"
GPU_CLUSTER = DEPLOY / "gpu-cluster.yaml"
EXAMPLE_1T = DEPLOY / "gpu-1t-ep16.yaml"
CONFIG_48B = DEPLOY / "models" / "Kimi-Linear-48B-A3B-Instruct"
CONFIG_1T = DEPLOY / "models" / "kimi-linear-shape-1t-moe"


def test_the_48b_plan_at_tensor_parallel_2_is_per_rank():
    model = KimiLinearModelConfig.from_pretrained(CONFIG_48B)
    config = load_config(GPU_CLUSTER)
    one = {p.pool: p for p in plan_cluster(config, model)}
    two = {p.pool: p for p in plan_cluster(config, model, tensor_parallel=2)}
    for pool in ("prefill", "decode"):
        a, b = one[pool], two[pool]
        assert b.tensor_parallel == 2 and not b.expert_parallel
        # the latent path, norms and routers are whole on each rank: a little over half the weights
        assert a.weight_bytes / 2 < b.weight_bytes < 0.51 * a.weight_bytes
        assert b.unit.slot_bytes == a.unit.slot_bytes // 2  # KDA states: half the heads each
        assert b.unit.block_bytes == a.unit.block_bytes  # MLA latent rows: replicated
        assert b.fits is True and b.cache is not None and b.cache.num_blocks > a.cache.num_blocks
        traffic = b.traffic
        assert traffic is not None and a.traffic is None
        assert traffic.num_allreduces == 2 * 27 + 1
        assert traffic.allreduce_payload_bytes_per_token == 55 * 2304 * 2  # bf16 hidden states
        assert traffic.allreduce_ring_bytes_per_token == 55 * 2304 * 2  # 2 (N-1)/N = 1 at N = 2
        assert traffic.logits_gather_bytes_per_row == 163840 * 4 // 2


def test_the_1t_moe_at_expert_parallel_16_fits_two_8_gpu_nodes(capsys):
    model = KimiLinearModelConfig.from_pretrained(CONFIG_1T)
    assert len(model.mla_layer_ids) == 16 and model.num_local_experts == 384
    args = ["config", "plan", str(EXAMPLE_1T), "--tensor-parallel", "16", "--expert-parallel", "--json"]
    assert main(args) == 0
    (plan,) = json.loads(capsys.readouterr().out)["pools"]
    assert plan["tensor_parallel"] == 16 and plan["expert_parallel"] is True and plan["fits"] is True
    assert 64.9e9 < plan["num_params"] < 65.1e9  # 24 whole experts per MoE layer, 1/16 of the rest
    assert 121 * 2**30 < plan["weight_bytes"] < 122 * 2**30
    whole = CachePlan.specs(model, block_size=64, dtype="bfloat16")
    assert plan["slot_bytes"] == whole.slot_bytes // 16
    assert plan["traffic"]["num_allreduces"] == 2 * 61 + 1
    assert main(args[:-1]) == 0
    table = capsys.readouterr().out
    assert "tensor_parallel 16, expert_parallel" in table and "65.00 B parameters per rank of 16" in table


def test_a_layout_the_ranks_cannot_split_is_refused(capsys):
    args = ["config", "plan", str(GPU_CLUSTER), "--tensor-parallel", "3"]
    assert main(args) == 1
    assert "vocab_size (163840) does not split evenly over tensor_parallel_size 3" in capsys.readouterr().err


def test_planning_ranks_needs_no_torch():
    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"assert main(['config', 'plan', {str(EXAMPLE_1T)!r}, '--tensor-parallel', '16', '--expert-parallel']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    assert "prefill: fits" in run_python(code)
