"""`splitserve config plan` and `up`'s refusal: the plan agrees with what the engine allocates,
the 48B plan's figures, and a config that cannot fit is refused before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from cli.main import main
from deploy.launcher import ClusterError, check_memory_plan, required_resources
from deploy.local_deployments import RUNTIME_DIR_ENV
from splitserve.config import load_config, parse_config
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.memory_plan import plan_cluster, read_model_config
from splitserve.tiny_model import make_tiny_model
from tests.python_process import run_python

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "configs"
GPU_CLUSTER = DEPLOY / "gpu-cluster.yaml"
CONFIG_48B = DEPLOY / "models" / "Kimi-Linear-48B-A3B-Instruct" / "config.json"


@pytest.fixture(autouse=True)
def own_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Deployment claims of this test only: `up` here never meets a deployment someone else runs."""
    path = tmp_path_factory.mktemp("runtime")
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_one_gpu_example_shares_one_gpu_and_its_plan_fits(tiny_path, capsys):
    """deploy/configs/gpu-one.yaml: both pools on CUDA, one GPU in all, and `config plan` prints
    a plan that fits from the config alone (each worker's share is given: no GPU is needed here)."""
    path = DEPLOY / "gpu-one.yaml"
    config = load_config(path)
    assert {config.engine_config(pool).device for pool in config.pool_names} == {"cuda"}
    assert required_resources(config)["GPU"] == 1.0
    assert main(["config", "plan", str(path), "--model-config", str(tiny_path)]) == 0
    out = capsys.readouterr().out
    assert "prefill: fits" in out and "decode: fits" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tiny_plan_fits_and_is_what_the_engine_allocates(tiny_path, tmp_path, dtype):
    import torch

    from splitserve.engine.llm_engine import LLMEngine

    config = parse_config({"model": {"path": str(tiny_path), "dtype": dtype}, "decode": {"block_size": 32}})
    model, source = read_model_config(config)
    assert source == str(tiny_path / "config.json")
    for plan in plan_cluster(config, model):
        assert plan.fits is True and plan.device_memory_source == "this machine's RAM"
        engine = LLMEngine(config.engine_config(plan.pool, model_path=str(tiny_path)))
        assert plan.cache is not None
        assert (engine.plan.num_blocks, engine.plan.num_slots) == (plan.cache.num_blocks, plan.num_slots)
        assert engine.max_model_len == plan.max_model_len
        caches = engine.caches
        rings = (
            []
            if caches.replay is None
            else [t for r in caches.replay.layers.values() for t in (r.k, r.u, r.g)]
        )
        cache_tensors = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (
                *caches.mla_kv.values(),
                *caches.kda_conv.values(),
                *caches.kda_recurrent.values(),
                *rings,
            )
        }
        assert sum(cache_tensors.values()) == plan.cache.total_bytes
        owned = {id(t): t for t in (*engine.model.parameters(), *engine.model.buffers())}
        assert sum(t.nbytes for t in owned.values()) == plan.weight_bytes
        fused = {
            id(v): v.nbytes
            for module in engine.model.modules()
            for v in vars(module).values()
            if isinstance(v, torch.Tensor) and id(v) not in owned
        }
        assert sum(fused.values()) == plan.fused_bytes


def test_the_48b_plan_for_the_gpu_example(capsys):
    config = load_config(GPU_CLUSTER)
    model = KimiLinearModelConfig.from_dict(json.loads(CONFIG_48B.read_text()))
    assert model.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26] and len(model.kda_layer_ids) == 20
    prefill, decode = plan_cluster(config, model)
    assert 49.0e9 < decode.num_params < 49.2e9
    assert 91 * 2**30 < decode.weight_bytes < 92 * 2**30
    assert 41 * 2**20 < decode.unit.slot_bytes < 42 * 2**20  # KDA state per request
    assert decode.unit.block_bytes // decode.unit.mla.block_size == 7 * (512 + 64) * 2  # MLA KV per token
    assert decode.num_slots == 256 and prefill.num_slots == 32
    assert decode.max_model_len == prefill.max_model_len == 131072
    assert decode.fits is True and prefill.fits is True
    # the CLI finds the shipped config.json by model.path's folder name (nothing is downloaded here)
    assert main(["config", "plan", str(GPU_CLUSTER), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "shipped copy" in shown["model_config"]
    assert [p["num_blocks"] for p in shown["pools"]] == [prefill.cache.num_blocks, decode.cache.num_blocks]


def test_the_table_names_each_pool_and_says_it_fits(capsys):
    assert main(["config", "plan", str(GPU_CLUSTER), "--model-config", str(CONFIG_48B.parent)]) == 0
    out = capsys.readouterr().out
    assert "49.12 B parameters" in out and "41.41 MiB of KDA state" in out
    assert "prefill: fits" in out and "decode: fits" in out


def test_a_device_too_small_is_refused_by_plan(tmp_path, capsys):
    pools = "{num_gpus: 1, device_memory_bytes: 120GiB, kv_cache_memory_bytes: 8GiB}"
    decode = "{num_gpus: 1, device_memory_bytes: 120GiB, kv_cache_memory_bytes: 32GiB}"
    path = write(tmp_path, f"model: {{dtype: bfloat16}}\nprefill: {pools}\ndecode: {decode}\n")
    assert main(["config", "plan", path, "--model-config", str(CONFIG_48B)]) == 1
    out = capsys.readouterr().out
    assert "decode: needs" in out and "but the device has 120.00 GiB (config: device_memory_bytes)" in out
    assert "lower decode.kv_cache_memory_bytes" in out and "prefill: fits" in out


def test_a_budget_too_small_for_max_model_len_does_not_fit(tmp_path, capsys):
    path = write(tmp_path, "model: {max_model_len: 131072}\nprefill: {device_memory_bytes: 200GiB}\n")
    assert main(["config", "plan", path, "--model-config", str(CONFIG_48B), "--json"]) == 1
    prefill = json.loads(capsys.readouterr().out)["pools"][0]
    assert prefill["fits"] is False and prefill["num_blocks"] is None
    assert "kv_cache_memory_bytes=268,435,456 is too small" in prefill["problems"][0]


def test_the_48b_at_tensor_parallel_2_on_8_gpus_is_4_replicas_of_2_gpus(tmp_path, capsys):
    """Each rank reserves a GPU of its own: 4 replicas x 2 ranks take the 8 GPUs, each rank holding
    half the weights (the plan per rank, from config.json alone)."""
    pool = "{replicas: 4, num_gpus: 1, tensor_parallel: 2, device_memory_bytes: 139GiB, kv_cache_memory_bytes: 32GiB}"
    path = write(tmp_path, f"model: {{dtype: bfloat16}}\nmode: colocated\nprefill: {pool}\n")
    assert required_resources(load_config(path))["GPU"] == 8
    assert main(["config", "plan", path, "--model-config", str(CONFIG_48B)]) == 0
    out = capsys.readouterr().out
    assert "cuda, 4 replicas, tensor_parallel 2 (8 GPUs)" in out and "prefill: fits" in out


def test_an_unknown_device_is_exit_3(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("splitserve.memory_plan.visible_gpu_memory_bytes", lambda: None)
    pools = "{num_gpus: 1, kv_cache_memory_bytes: 8GiB}"
    path = write(tmp_path, f"model: {{dtype: bfloat16}}\nprefill: {pools}\ndecode: {pools}\n")
    assert main(["config", "plan", path, "--model-config", str(CONFIG_48B)]) == 3
    assert "set prefill.device_memory_bytes" in capsys.readouterr().out


def test_a_missing_model_config_says_what_to_pass(tmp_path, capsys):
    path = write(tmp_path, f"model: {{path: {tmp_path / 'not-downloaded'}}}\n")
    assert main(["config", "plan", path]) == 1
    assert "has no config.json on this machine; pass --model-config" in capsys.readouterr().err


def test_up_refuses_a_plan_that_does_not_fit_before_starting_ray(tiny_path, tmp_path, capsys):
    path = write(tmp_path, f"model: {{path: {tiny_path}}}\nprefill: {{device_memory_bytes: 64MiB}}\n")
    assert main(["up", "--config", path]) == 1
    err = capsys.readouterr().err
    assert "the memory plan does not fit" in err and "prefill: needs" in err and "64.00 MiB" in err
    assert not ray.is_initialized()


def test_the_plan_of_the_gpu_example_needs_no_torch():
    """A GPU-less head node plans without torch: the CLI's plan imports none."""
    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"assert main(['config', 'plan', {str(GPU_CLUSTER)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    assert "decode: fits" in run_python(code)


def test_with_a_remote_ray_only_pools_that_give_their_device_memory_are_checked(tiny_path):
    # the workers run elsewhere: this machine's RAM or GPU says nothing about their devices
    check_memory_plan(parse_config({"model": {"path": str(tiny_path)}}), detect_device=False)
    small = parse_config({"model": {"path": str(tiny_path)}, "decode": {"device_memory_bytes": "64MiB"}})
    with pytest.raises(ClusterError, match=r"decode: needs .* but the device has 64.00 MiB"):
        check_memory_plan(small, detect_device=False)


def test_a_worker_with_a_gpu_fraction_is_planned_against_its_share(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("splitserve.memory_plan.visible_gpu_memory_bytes", lambda: 140 * 2**30)
    pools = "{num_gpus: 0.5, kv_cache_memory_bytes: 8GiB}"
    path = write(tmp_path, f"model: {{dtype: bfloat16}}\nprefill: {pools}\ndecode: {pools}\n")
    # the 48B model's weights fit a whole H200 but not half of one
    assert main(["config", "plan", path, "--model-config", str(CONFIG_48B), "--json"]) == 1
    prefill = json.loads(capsys.readouterr().out)["pools"][0]
    assert prefill["device_memory_bytes"] == 70 * 2**30
    assert prefill["device_memory_source"] == "the visible GPU, its num_gpus 0.5 share"
