"""The cluster config: defaults, byte sizes, every cross-check's message, engine knobs, YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from deploy.actors import gateway_settings_kwargs
from deploy.launcher import required_resources
from deploy.worker_spec import WorkerSpec, bundle_of
from frontend.settings import GatewaySettings
from splitserve.config import (
    ClusterConfig,
    ConfigError,
    PoolConfig,
    default_config,
    format_bytes,
    gateway_api_keys,
    load_config,
    parse_bytes,
    parse_config,
    with_gateway_address,
)
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.tiny_model import make_tiny_model

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


def test_the_shipped_default_file_equals_the_embedded_default():
    assert load_config(DEPLOY / "default.yaml") == default_config()


def test_the_default_is_one_prefill_and_one_decode_worker_on_cpus():
    config = default_config()
    assert config.mode == "disaggregated" and config.pool_names == ("prefill", "decode")
    assert config.model.path is None and config.model.served_name == "tiny-kimi-linear"
    assert config.store.memory_bytes == 2 * 2**30 and config.store.disk.bytes == 20 * 2**30
    assert config.prefill.kv_cache_memory_bytes == 256 * 2**20
    assert (config.gateway.host, config.gateway.port, config.gateway.num_cpus) == ("127.0.0.1", 8000, 0.25)


def test_the_gpu_example_is_valid():
    config = load_config(DEPLOY / "gpu-cluster.yaml")
    assert config.decode.num_gpus == 1 and config.engine_config("decode").device == "cuda"
    assert config.model.served_name == "kimi-linear-48b-a3b-instruct"


def test_an_empty_file_is_the_default(tmp_path):
    assert load_config(write(tmp_path, "")) == default_config()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1.5 GiB", 3 * 2**29),
        ("4096", 4096),
        ("10kb", 10_000),
        (7, 7),
    ],
)
def test_byte_sizes_accept_ints_and_unit_strings(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2 GBs", "GiB", "-1", "1.5B", "two", True, 1.5])
def test_bad_byte_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_byte_sizes_are_written_back_in_exact_binary_units():
    assert [format_bytes(n) for n in (2 * 2**30, 3 * 2**29, 1000)] == ["2GiB", "1536MiB", 1000]


def test_a_bad_byte_string_names_the_file_and_key(tmp_path):
    message = error_of(tmp_path, "store: {memory_bytes: 2 GBs}")
    assert message.startswith(f"{tmp_path / 'cluster.yaml'}: store.memory_bytes:")
    assert "'2 GBs' is not a byte size" in message and "2GiB" in message


def test_a_misspelt_key_is_an_error_with_a_suggestion(tmp_path):
    message = error_of(tmp_path, "prefill: {replcas: 2}")
    assert "prefill.replcas: unknown key (did you mean 'replicas'?)" in message


def test_an_unknown_section_lists_the_known_ones(tmp_path):
    assert "prefil: unknown key (did you mean 'prefill'?)" in error_of(tmp_path, "prefil: {replicas: 2}")


def test_prefix_cache_keys_reach_every_pool_engine(tmp_path):
    text = "cache: {prefix_unit: 32, retention_interval: 128, selective_retention: false}"
    config = load_config(write(tmp_path, text))
    for pool in ("prefill", "decode"):
        engine = config.engine_config(pool, model_path="m")
        assert engine.enable_prefix_caching
        assert (engine.prefix_unit, engine.retention_interval, engine.selective_retention) == (32, 128, False)


def test_prefix_caching_is_on_by_default_and_off_when_asked(tmp_path):
    assert default_config().engine_config("prefill", model_path="m").enable_prefix_caching
    config = load_config(write(tmp_path, "cache: {enable_prefix_caching: false}"))
    assert not config.engine_config("decode", model_path="m").enable_prefix_caching


def test_only_pools_that_decode_may_capture_cuda_graphs():
    config = default_config()
    assert config.engine_config("prefill", model_path="m").enforce_eager
    assert not config.engine_config("decode", model_path="m").enforce_eager
    colocated = ClusterConfig(mode="colocated")
    assert not colocated.engine_config(colocated.pool_names[0], model_path="m").enforce_eager


def test_a_prefix_unit_must_be_whole_blocks_of_every_pool(tmp_path):
    message = error_of(tmp_path, "cache: {prefix_unit: 48}\ndecode: {block_size: 32}")
    assert "cache.prefix_unit: must be a multiple of decode.block_size (32; got 48)" in message


def test_a_retention_interval_must_be_whole_prefix_units(tmp_path):
    message = error_of(tmp_path, "cache: {prefix_unit: 64, retention_interval: 100}")
    assert "cache.retention_interval: must be a multiple of cache.prefix_unit (64; got 100)" in message


def test_pools_choose_their_block_size_each(tmp_path):
    # the state moves as token rows, so a decode pool need not page its KV like the prefill pool
    config = load_config(write(tmp_path, "decode: {block_size: 32}"))
    sizes = [config.engine_config(pool, model_path="m").block_size for pool in ("prefill", "decode")]
    assert sizes == [16, 32]


@pytest.mark.parametrize("section", sorted(ClusterConfig.model_fields))
def test_every_key_is_described_in_the_deploy_readme(section):
    """Each key the schema accepts says in deploy/README.md what it changes."""
    readme = (DEPLOY.parent / "README.md").read_text(encoding="utf-8")
    field = ClusterConfig.model_fields[section]
    keys = [section]
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
        shared = set(PoolConfig.model_fields) if issubclass(field.annotation, PoolConfig) else set()
        # keys every pool has share one table row (`<pool>.key`); a pool's own keys are named in full
        keys = [
            f"{'<pool>' if key.split('.')[0] in shared else section}.{key}"
            for key in _leaf_keys(field.annotation)
        ]
    missing = [key for key in keys if f"`{key}`" not in readme]
    assert not missing, f"deploy/README.md does not describe {missing}"


def test_a_pools_custom_resources_go_into_its_bundle(tmp_path):
    config = load_config(
        write(tmp_path, "decode: {num_cpus: 2, resources: {decode_host: 1, 'node:10.0.0.2': 0.5}}")
    )
    assert config.prefill.resources == {}
    assert bundle_of(config.decode) == {"CPU": 2.0, "decode_host": 1.0, "node:10.0.0.2": 0.5}


def test_a_local_ray_is_sized_for_the_pools_custom_resources_too(tmp_path):
    config = load_config(write(tmp_path, "decode: {replicas: 2, resources: {decode_host: 1.5}}"))
    # gateway 0.25 + store 0.25 + prefill 1 + 2 decode x 1 CPUs; the local Ray `up` starts has these
    assert required_resources(config) == {"CPU": 3.5, "GPU": 0.0, "decode_host": 3.0}


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ("{CPU: 2}", "decode.resources: 'CPU' is not a custom resource: set num_cpus instead"),
        ("{GPU: 1}", "decode.resources: 'GPU' is not a custom resource: set num_gpus instead"),
        ("{decode_host: 0}", "decode.resources: each resource needs a name and an amount above 0"),
        ("{decode_host: many}", "decode.resources.decode_host: Input should be a valid number"),
    ],
)
def test_bad_custom_resources_are_refused_naming_the_key(tmp_path, resources, message):
    assert message in error_of(tmp_path, f"decode: {{resources: {resources}}}")


def test_tensor_and_expert_parallel_per_pool_reach_the_engines(tmp_path):
    config = load_config(
        write(tmp_path, "prefill: {tensor_parallel: 2}\ndecode: {tensor_parallel: 4, expert_parallel: true}")
    )
    engines = [config.engine_config(pool, model_path="m") for pool in ("prefill", "decode")]
    assert [(e.tensor_parallel_size, e.expert_parallel) for e in engines] == [(2, False), (4, True)]
    # a bundle per rank: gateway 0.25 + store 0.25 + prefill 2 x 1 + decode 4 x 1 CPUs
    assert required_resources(config) == {"CPU": 6.5, "GPU": 0.0}


def test_a_tensor_parallel_pool_on_gpus_reserves_a_gpu_per_rank(tmp_path):
    config = load_config(
        write(tmp_path, "prefill: {num_gpus: 1, tensor_parallel: 2}\ndecode: {num_gpus: 1, replicas: 3}")
    )
    engine = config.engine_config("prefill", model_path="m")
    assert (engine.device, engine.tensor_parallel_size) == ("cuda", 2)
    spec = WorkerSpec.of(config.prefill, engine)
    assert (spec.bundle, spec.num_ranks) == ({"CPU": 1.0, "GPU": 1.0}, 2)  # a bundle per rank
    assert required_resources(config)["GPU"] == 5  # prefill 1 x 2 ranks + decode 3 x 1


def test_a_tensor_parallel_decode_pool_keeps_stored_state(tmp_path):
    """ReplaySSM publishes work at any width (each rank's KDA heads are stored as pieces of their own)."""
    config = load_config(write(tmp_path, "decode: {tensor_parallel: 2, replay_window: 8}"))
    engine = config.engine_config("decode", model_path="m")
    assert (engine.tensor_parallel_size, engine.replay_window) == (2, 8)


@pytest.mark.parametrize(
    "section,message",
    [
        (
            "decode: {tensor_parallel: 2, placement: SPREAD}",
            "decode: placement SPREAD with tensor_parallel 2: a replica's ranks run on one node",
        ),
        (
            "prefill: {tensor_parallel: 2, preemption_mode: swap}",
            "prefill: preemption_mode swap with tensor_parallel > 1",
        ),
        (
            "decode: {tensor_parallel: 2, num_gpus: 0.5}",
            "decode: num_gpus 0.5 with tensor_parallel 2: each rank takes a whole GPU of its own",
        ),
        (
            "prefill: {expert_parallel: true}",
            "prefill: expert_parallel spreads experts over a replica's ranks",
        ),
    ],
)
def test_what_tensor_parallel_pools_cannot_run_is_refused_naming_it(tmp_path, section, message):
    assert message in error_of(tmp_path, section)


def test_colocated_mode_refuses_a_decode_pool(tmp_path):
    message = error_of(tmp_path, "mode: colocated\ndecode: {replicas: 2}")
    assert "decode.replicas: colocated mode" in message and "set decode.replicas: 0" in message
    message = error_of(tmp_path, "mode: colocated\ndecode: {max_num_seqs: 8}")  # replicas defaults to 1
    assert "decode.replicas" in message


def test_colocated_mode_without_a_decode_section_has_one_pool(tmp_path):
    config = load_config(write(tmp_path, "mode: colocated\nprefill: {replicas: 2}"))
    assert config.pool_names == ("prefill",) and config.pool_role("prefill") == "colocated"
    assert config.decode.replicas == 0
    assert load_config(write(tmp_path, "mode: colocated\ndecode: {replicas: 0}")).pool_names == ("prefill",)


def test_pools_need_a_replica_and_no_negative_gpus(tmp_path):
    assert "decode.replicas: must be at least 1 (got 0)" in error_of(tmp_path, "decode: {replicas: 0}")
    message = error_of(tmp_path, "prefill: {replicas: 0, fallback: fail}")
    assert "prefill.replicas: must be at least 1 (got 0); 0 removes the prefill pool only with" in message
    # the decode workers compute the prompts: a deployment without a prefill pool
    assert load_config(write(tmp_path, "prefill: {replicas: 0}")).prefill.replicas == 0
    assert "prefill.replicas" in error_of(tmp_path, "mode: colocated\nprefill: {replicas: 0}")
    assert "decode.num_gpus: Input should be greater than or equal to 0" in error_of(
        tmp_path, "decode: {num_gpus: -1}"
    )


def test_several_problems_are_reported_together(tmp_path):
    message = error_of(tmp_path, "gateway: {port: 70000}\nhealth: {interval_s: 0}")
    assert "2 problems" in message and "gateway.port" in message and "health.interval_s" in message


def test_bad_yaml_and_missing_files_name_the_file(tmp_path):
    assert "not valid YAML at line 1" in error_of(tmp_path, "model: [1")
    assert "the top level must be a mapping" in error_of(tmp_path, "- 1")
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_the_config_is_frozen():
    config = default_config()
    with pytest.raises(ValidationError):
        config.mode = "colocated"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.prefill.replicas = 4  # type: ignore[misc]


def test_engine_config_is_derived_per_pool():
    config = parse_config(
        {
            "model": {"path": "~/models/kimi", "dtype": "bfloat16", "max_model_len": 4096},
            "prefill": {"num_cpus": 2, "max_num_batched_tokens": 512, "kv_cache_memory_bytes": "1GiB"},
            "decode": {"num_gpus": 1, "max_num_seqs": 128},
        }
    )
    prefill = config.engine_config("prefill")
    assert isinstance(prefill, EngineConfig)
    assert prefill.model == str(Path("~/models/kimi").expanduser())
    assert (prefill.dtype, prefill.device, prefill.num_threads) == ("bfloat16", "cpu", 2)
    assert (prefill.max_num_batched_tokens, prefill.kv_cache_memory_bytes) == (512, 2**30)
    assert (prefill.max_model_len, prefill.block_size) == (4096, 16)
    decode = config.engine_config("decode")
    assert (decode.device, decode.num_threads, decode.max_num_seqs) == ("cuda", None, 128)
    assert config.model.served_name == "kimi"
    with pytest.raises(ValueError, match="no pool 'colocated'"):
        config.engine_config("colocated")


def test_yaml_round_trip_gives_an_equal_config(tmp_path):
    original = parse_config(
        {
            "mode": "colocated",
            "gateway": {"api_keys": ["k1"], "port": 9000},
            "prefill": {"replicas": 3, "placement": "STRICT_SPREAD", "kv_cache_memory_bytes": "1.5GiB"},
            "store": {"memory_bytes": 1000, "disk": {"path": None}},
        }
    )
    text = original.to_yaml()
    assert "kv_cache_memory_bytes: 1536MiB" in text
    assert load_config(write(tmp_path, text)) == original
    assert isinstance(yaml.safe_load(text), dict)
    assert ClusterConfig.model_validate(original.model_dump()) == original


def test_the_gateway_settings_carry_the_configs_gateway_keys():
    config = parse_config({"gateway": {"api_keys": ["k"], "port": 9001}, "health": {"drain_timeout_s": 5}})
    settings = GatewaySettings(**gateway_settings_kwargs(config, None))
    assert (settings.port, settings.api_keys, settings.drain_timeout_s) == (9001, ("k",), 5)
    with pytest.raises(ConfigError, match="health.drain_timeout_s"):
        parse_config({"health": {"drain_timeout_s": -1}})


def _leaf_keys(section: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in section.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += [f"{name}.{key}" for key in _leaf_keys(field.annotation)]
        else:
            keys.append(name)
    return keys


@pytest.fixture(scope="module")
def long_context_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("long-context"), max_position_embeddings=2**20)


def test_the_gateway_is_told_the_shortest_length_the_pools_choose(long_context_path):
    path = str(long_context_path)
    config = parse_config(
        {
            "model": {"path": path},
            "prefill": {"kv_cache_memory_bytes": "8MiB", "max_num_seqs": 4},
            "decode": {"kv_cache_memory_bytes": "16MiB", "max_num_seqs": 4},
        }
    )
    engines = {pool: LLMEngine(config.engine_config(pool, model_path=path)) for pool in config.pool_names}
    assert engines["prefill"].max_model_len < engines["decode"].max_model_len < 2**20
    assert gateway_settings_kwargs(config, path)["max_model_len"] == engines["prefill"].max_model_len


def test_an_explicit_max_model_len_goes_to_the_gateway_as_is(long_context_path):
    config = parse_config({"model": {"path": str(long_context_path), "max_model_len": 4096}})
    assert gateway_settings_kwargs(config, str(long_context_path))["max_model_len"] == 4096
    unreadable = parse_config({"model": {"path": "/nowhere", "max_model_len": 4096}})
    assert gateway_settings_kwargs(unreadable, "/nowhere")["max_model_len"] == 4096
    assert "max_model_len" not in gateway_settings_kwargs(
        parse_config({"model": {"path": "/nowhere"}}), "/nowhere"
    )


def test_the_gateway_address_can_be_overridden_and_is_validated():
    config = default_config()
    moved = with_gateway_address(config, host=None, port=9000)
    assert (moved.gateway.host, moved.gateway.port) == (config.gateway.host, 9000)
    assert moved.prefill == config.prefill and config.gateway.port != 9000  # the original is unchanged
    assert with_gateway_address(config, host=None, port=None) is config
    with pytest.raises(ConfigError, match="--host/--port"):
        with_gateway_address(config, host=None, port=70000)


def test_placement_keys_take_custom_resources_labels_and_gpu_fractions(tmp_path):
    config = load_config(
        write(
            tmp_path, "prefill: {num_gpus: 0.5, resources: {prefill_node: 1}, node_labels: {node-type: h200}}"
        )
    )
    assert (config.prefill.num_gpus, config.prefill.resources) == (0.5, {"prefill_node": 1.0})
    assert config.prefill.node_labels == {"node-type": "h200"}
    assert config.engine_config("prefill", model_path="m").device == "cuda"
    assert "decode.num_gpus: num_gpus is per rank: give 1 (and tensor_parallel N" in error_of(
        tmp_path, "decode: {num_gpus: 2}"
    )
    message = error_of(tmp_path, "decode: {resources: {object_store_memory: 1}}")
    assert "decode.resources: 'object_store_memory' is Ray's own resource" in message
    assert "above 0" in error_of(tmp_path, "decode: {resources: {slot: 0}}")
    assert "needs a key and a value" in error_of(tmp_path, "decode: {node_labels: {zone: ''}}")


def test_api_keys_come_from_a_variable_or_a_file_and_never_show_in_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GATEWAY_KEYS", "k-one, k-two\nk-three")
    from_env = parse_config({"gateway": {"api_keys_env": "GATEWAY_KEYS"}})
    assert gateway_api_keys(from_env.gateway) == ("k-one", "k-two", "k-three")
    assert gateway_settings_kwargs(from_env, None)["api_keys"] == ["k-one", "k-two", "k-three"]
    assert "k-one" not in from_env.to_yaml()
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated weekly\nk-file\n\n  k-file-2  \n")
    from_file = parse_config({"gateway": {"api_keys_file": str(keys_file)}})
    assert gateway_api_keys(from_file.gateway) == ("k-file", "k-file-2")

    monkeypatch.setenv("GATEWAY_KEYS", " , ")
    with pytest.raises(ValueError, match="the variable GATEWAY_KEYS holds no key") as empty:
        gateway_api_keys(from_env.gateway)
    monkeypatch.delenv("GATEWAY_KEYS")
    with pytest.raises(ValueError, match="the variable GATEWAY_KEYS is not set") as unset:
        gateway_api_keys(from_env.gateway)
    keys_file.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key") as no_key:
        gateway_api_keys(from_file.gateway)
    keys_file.unlink()
    with pytest.raises(ValueError, match=f"cannot read {keys_file}"):
        gateway_api_keys(from_file.gateway)
    assert not any("k-" in str(info.value) for info in (empty, unset, no_key))

    assert "give the API keys one way, not api_keys and api_keys_env" in error_of(
        tmp_path, "gateway: {api_keys: [a], api_keys_env: KEYS}"
    )
    assert "gateway.api_keys_env: String should match pattern" in error_of(
        tmp_path, "gateway: {api_keys_env: 'not a name'}"
    )


def test_gateway_replicas_are_bounded_and_a_local_ray_has_room_for_each(tmp_path):
    config = load_config(write(tmp_path, "gateway: {replicas: 4, num_cpus: 1}\ndecode: {replicas: 2}"))
    assert (config.gateway.replicas, config.gateway.placement) == (4, "head")
    # 4 gateways x 1 + store 0.25 + prefill 1 + 2 decode x 1 CPUs
    assert required_resources(config)["CPU"] == 7.25
    for bad in ("gateway: {replicas: 0}", "gateway: {replicas: 65}", "gateway: {placement: anywhere}"):
        with pytest.raises(ConfigError, match="gateway"):
            load_config(write(tmp_path, bad))
