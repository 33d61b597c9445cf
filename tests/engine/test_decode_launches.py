"""Kernel launches of a decode step on the CUDA code path, counted on the CPU (experiments/decode_launches.py):
the counter sees the stubbed kernels where the layers launch them, and the 1B model's step stays
within its launch budget, so fused kernels cannot quietly fall back to many small ops."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the kernels' Python wrappers import it

from experiments import decode_launches  # noqa: E402

# launches per decoder layer of a decode step (most of any layer), and per step, 1B shape
MAX_LAUNCHES_PER_LAYER = 16
MAX_LAUNCHES_PER_STEP = 192


def test_the_counter_sees_each_layers_kernels_in_its_module():
    config = decode_launches.model_config("tiny")
    step = decode_launches.count_decode_step(config, batch_size=2, context=40)
    for layer, kind in enumerate(config.layer_types):
        attention = f"model.layers.{layer}.self_attn"
        launch = "triton:paged_mla" if kind == "full_attention" else "fla:fused_recurrent_kda_fwd"
        assert step.counts[(attention, launch)] == 1, (layer, kind)
        if config.mlp_layer_types[layer] == "sparse":  # the routed and shared experts in two GEMM launches
            moe = f"model.layers.{layer}.block_sparse_moe"
            assert step.counts[(moe, "triton:moe_grouped_gemm")] == 2, layer
    assert step.counts[(decode_launches.RUNNER, "host_to_device_copy")] == 1
    assert step.counts[(decode_launches.SAMPLER, "device_to_host_copy")] == 1
    assert step.total == sum(step.per_layer()) + sum(step.outside_layers().values())


@pytest.mark.parametrize("replay_window", [0, 16])
@pytest.mark.parametrize("batch_size", [1, 64])
def test_a_1b_decode_step_stays_within_its_launch_budget(batch_size, replay_window):
    config = decode_launches.model_config("1b")
    step = decode_launches.count_decode_step(config, batch_size, replay_window=replay_window)
    report = decode_launches.report(step, verbose=True)
    assert max(step.per_layer()) <= MAX_LAUNCHES_PER_LAYER, report
    assert step.total <= MAX_LAUNCHES_PER_STEP, report


def test_the_command_prints_launches_per_step_and_per_layer(capsys):
    assert decode_launches.main(["--model", "tiny", "--batch-sizes", "1,3", "--context", "20"]) == 0
    out = capsys.readouterr().out
    assert out.count("launches per decode step") == 2
    assert "launches per layer" in out and "KDA+MoE" in out and "MLA+MoE" in out


def test_a_replay_ssm_decode_launches_its_ring_kernel_in_each_kda_layer():
    config = decode_launches.model_config("tiny")
    step = decode_launches.count_decode_step(config, batch_size=3, context=40, replay_window=4)
    for layer in config.kda_layer_ids:
        attention = f"model.layers.{layer}.self_attn"
        assert step.counts[(attention, "triton:replay_step")] == 1, layer
        assert step.counts[(attention, "fla:fused_recurrent_kda_fwd")] == 0, layer
