"""`apply` on a real deployment (local Ray: controller, gateway, workers and store as processes)
under a bounded closed-loop load of greedy streams: a config that adds a decode replica, one
that changes a prefill engine setting (the prefill pool is rolled: the new replica serves before
the old one drains), one that removes the added decode replica while it streams, then one that
removes the prefill pool (the decode worker computes prompts) and one that brings it back. Every
request succeeds with the offline engine's tokens; none needed the gateway's decode failover,
nor, while the prefill pool had a worker, its prefill fallback (the drains, not the safety nets,
kept them whole). Then a model change is refused with the reason, and nothing changed;
afterwards nothing is held."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import ClusterConfig, parse_config
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import assert_idle, worker_stats
from tests.faults.conftest import metric_value, wait_for
from tests.faults.load import ClosedLoopLoad, Outcome, random_prompts, summary

MODEL = "tiny"
NUM_CLIENTS = 4
NUM_TOKENS = 16
PROMPTS = random_prompts(seed=11, count=24, min_len=8, max_len=64)
POOL = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 8}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("apply-model"), seed=3)


@pytest.fixture(scope="module")
def expected(model_path: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from the offline engine."""
    llm = LLM(model=str(model_path), max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[params] * len(PROMPTS))
    return {tuple(p): r.outputs[0].token_ids for p, r in zip(PROMPTS, results)}


def config(
    model_path: Path, *, decode_replicas: int = 1, prefill: dict[str, Any] | None = None
) -> ClusterConfig:
    return parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": {**POOL, **(prefill or {})},
            "decode": {**POOL, "replicas": decode_replicas},
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "drain_timeout_s": 120},
        }
    )


@pytest.fixture(scope="module")
def cluster(model_path: Path) -> Iterator[ClusterHandle]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with run_cluster(config(model_path)) as handle:
            yield handle
    finally:
        ray.shutdown()


def _body(client: int, n: int) -> dict[str, Any]:
    prompt = PROMPTS[(client * 5 + n) % len(PROMPTS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}


def _apply(
    load: ClosedLoopLoad, cluster: ClusterHandle, new: ClusterConfig, busy: tuple[str, int] | None = None
) -> tuple[list[str], float, float]:
    """Apply `new` once the load has requests going (and, with `busy`, that worker streams);
    (its plan, when it began, when it ended)."""
    count = len(load.outcomes)
    load.wait_for(lambda out: len(out) >= count + NUM_CLIENTS, "requests ending before the apply")
    if busy is not None:
        wait_for(lambda: worker_stats(cluster, *busy)["num_running"] > 0, f"streams on {busy}")
    began_s = time.monotonic()
    result = cluster.apply(new)
    return result["plan"], began_s, time.monotonic()


def _overlapping(outcomes: list[Outcome], began_s: float, ended_s: float) -> list[Outcome]:
    return [o for o in outcomes if o.started_s < ended_s and o.ended_s > began_s]


def test_apply_adds_rolls_and_removes_replicas_and_a_pool_under_load_failing_no_request(
    cluster, model_path, expected
):
    url = cluster.gateway_url or ""
    failovers = metric_value(url, "splitserve_decode_failovers_total")
    fallbacks = metric_value(url, "splitserve_prefill_fallbacks_total")
    old_prefill = cluster.status()["pools"]["prefill"]["addresses"]
    load = ClosedLoopLoad(url, _body, NUM_CLIENTS)
    windows = []
    try:
        plan, *window = _apply(load, cluster, config(model_path, decode_replicas=2))
        assert plan == ["decode: add 1 replica(s) (1 -> 2)"]
        windows.append(window)
        rolled = config(model_path, decode_replicas=2, prefill={"max_num_batched_tokens": 512})
        plan, *window = _apply(load, cluster, rolled)
        assert plan == [
            "prefill: roll 1 replica(s), one at a time: start one of the new spec, then drain one of "
            "the old (max_num_batched_tokens: 2048 -> 512)"
        ]
        windows.append(window)
        (rolled_prefill,) = cluster.status()["pools"]["prefill"]["workers"]
        rolled_tokens = _batched_tokens_of(cluster, "prefill", rolled_prefill["index"])
        added = cluster.status()["pools"]["decode"]["workers"][-1]["index"]  # the newest: removed first
        removed = config(model_path, prefill={"max_num_batched_tokens": 512})
        plan, *window = _apply(load, cluster, removed, busy=("decode", added))
        assert plan == ["decode: drain and remove 1 replica(s) (2 -> 1), outdated ones first"]
        windows.append(window)
        # until here a prefill worker always served; now the pool goes (the decode worker computes
        # the prompts: prefill.fallback decode_local) and comes back
        fallbacks_before_removal = metric_value(url, "splitserve_prefill_fallbacks_total")
        no_prefill = config(model_path, prefill={"max_num_batched_tokens": 512, "replicas": 0})
        plan, *window = _apply(load, cluster, no_prefill)
        assert plan == ["prefill: drain and remove 1 replica(s) (1 -> 0): the pool goes"]
        windows.append(window)
        count = len(load.outcomes)
        load.wait_for(lambda out: len(out) >= count + NUM_CLIENTS, "requests without a prefill pool")
        plan, *window = _apply(load, cluster, removed)
        assert plan == ["prefill: add 1 replica(s) (0 -> 1)"]
        windows.append(window)
        count = len(load.outcomes)
        load.wait_for(lambda out: len(out) >= count + NUM_CLIENTS, "requests after the last apply")
    finally:
        outcomes = load.stop()

    assert all(o.ok for o in outcomes), summary(outcomes)
    wrong = [o for o in outcomes if o.token_ids != expected[tuple(o.prompt)]]
    assert not wrong, f"{len(wrong)} of {len(outcomes)} requests got other tokens"
    for began_s, ended_s in windows:  # each converge ran under load
        assert len(_overlapping(outcomes, began_s, ended_s)) >= NUM_CLIENTS
    assert metric_value(url, "splitserve_decode_failovers_total") == failovers, "a stream was cut"
    assert fallbacks_before_removal == fallbacks, "a prompt found no prefill worker while the pool had one"
    assert (
        metric_value(url, "splitserve_prefill_fallbacks_total") > fallbacks
    )  # the pool's absence was served
    # the rolled replica ran the new setting, and so does the one that came back
    assert rolled_prefill["address"] not in old_prefill and rolled_tokens == 512
    status = cluster.status()
    pools = status["pools"]
    assert (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (1, 1) and status["healthy"]
    assert _batched_tokens_of(cluster, "prefill", pools["prefill"]["workers"][0]["index"]) == 512
    assert status["apply"]["done"] == ["prefill: add 1 replica(s)"] and status["apply"]["error"] is None

    elsewhere = config(model_path).model_dump(mode="json")
    elsewhere["model"]["path"] = "/elsewhere"
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        cluster.apply(parse_config(elsewhere))
    reason = str(refused.value.cause)
    assert f"model cannot change live (model.path: '{model_path}' -> '/elsewhere')" in reason
    assert "every worker and the gateway serve it" in reason and "nothing was changed" in reason
    assert _same_workers(cluster.status(), status)
    assert_idle(cluster, timeout_s=60)


def _batched_tokens_of(cluster: ClusterHandle, pool: str, index: int) -> int:
    """The max_num_batched_tokens a worker's engine runs, asked of the worker itself."""
    handle = ray.get(cluster.controller.worker_handle.remote(pool, index))
    return int(ray.get(handle.__ray_call__.remote(_batched_tokens)))


def _batched_tokens(worker: Any) -> int:
    return int(worker.engine_config.max_num_batched_tokens)


def _same_workers(now: dict[str, Any], before: dict[str, Any]) -> bool:
    """The same workers (addresses and processes) as before; their load figures may have moved."""

    def workers(status: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(w["address"], w["pid"]) for pool in status["pools"].values() for w in pool["workers"]]

    return workers(now) == workers(before)
