"""The autoscaler's loop (deploy/autoscale/planner.py) over a scripted gateway and a fake
converge: it reads percentiles over the last window only, acts through the converge hook,
counts and publishes each decision once, holds an up that does not fit and asks Ray's
autoscaler for the bundles, and judges nothing while the gateway cannot say the load.
Plus the window arithmetic and the config's checks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from deploy.autoscale.observe import GatewayView, observe
from deploy.autoscale.planner import Planner, PlannerHooks
from deploy.autoscale.resources import wanted_bundles
from deploy.autoscale.window import difference, quantile
from deploy.members import Member, Pool, Roster
from splitserve.config import ConfigError, SloConfig, parse_config

BOUNDS = [0.01, 0.05, 0.1, 0.5, "+Inf"]
AUTOSCALE = {
    "min_replicas": 1,
    "max_replicas": 2,
    "interval_s": 1,
    "scale_up_after_s": 2,
    "scale_down_after_s": 3,
    "cooldown_s": 2,
}


def buckets(*counts: float) -> list[tuple[float | str, float]]:
    """Cumulative counts per BOUNDS from counts per bucket."""
    total, out = 0.0, []
    for bound, count in zip(BOUNDS, counts):
        total += count
        out.append((bound, total))
    return out


def report(*, num_queued: int = 0, itl: list[tuple[float | str, float]] | None = None) -> dict[str, Any]:
    return {
        "num_queued": num_queued,
        "num_slots_in_use": 2 if num_queued else 0,
        "num_slots_capacity": 2,
        "decode": {"10.0.0.2:1": {"num_free_kv_blocks": 90, "num_total_kv_blocks": 100}},
        "prefill": {"10.0.0.1:1": {"num_outstanding_prompt_tokens": 0}},
        "histograms": {"ttft_s": [], "itl_s": itl or [], "queue_wait_s": []},
    }


class Scripted:
    """A deployment of one autoscaled decode pool: a clock the test moves, the gateway's next
    report, a converge that makes the members match at once, and what Ray was asked for."""

    def __init__(self, room: str | None = None, max_replicas: int = 2) -> None:
        self.config = parse_config(
            {"decode": {"num_cpus": 0.5, "autoscale": {**AUTOSCALE, "max_replicas": max_replicas}}}
        )
        spec = SimpleNamespace(bundle={"CPU": 0.5}, labels={})
        self.pool = Pool(name="decode", role="decode", spec=spec, replicas=1)  # type: ignore[arg-type]
        self.pool.members.append(Member(kind="decode", index=0))
        self.prefill = Pool(name="prefill", role="prefill", spec=spec, replicas=1)  # type: ignore[arg-type]
        self.now_s = 100.0
        self.next_report: dict[str, Any] | Exception = report()
        self.room = room
        self.scaled: list[tuple[str, int, str]] = []
        self.published: list[dict[str, Any]] = []
        self.asked: list[str | None] = []
        self.planner = Planner(
            PlannerHooks(
                config=lambda: self.config,
                pools={"prefill": self.prefill, "decode": self.pool},
                reports=self._reports,
                publish=self._publish,
                no_room=lambda name: self.room,
                scale=self._scale,
                ask_for_room=self.asked.append,
            ),
            clock=lambda: self.now_s,
        )

    async def _reports(self) -> list[dict[str, Any]]:
        if isinstance(self.next_report, Exception):
            raise self.next_report
        return [self.next_report]

    async def _publish(self, state: dict[str, Any]) -> None:
        self.published.append(state)

    async def _scale(self, name: str, replicas: int, reason: str) -> None:
        self.scaled.append((name, replicas, reason))
        self.pool.replicas = replicas
        while len(self.pool.members) < replicas:
            self.pool.members.append(Member(kind="decode", index=len(self.pool.members)))
        del self.pool.members[replicas:]

    def passes(self, seconds: int, **report_args: Any) -> None:
        """One pass a second for `seconds`, the gateway reporting `report_args` each time."""
        for _ in range(seconds):
            self.next_report = report(**report_args)
            asyncio.run(self.planner.pass_once())
            self.now_s += 1


def test_a_queue_that_lasts_adds_a_replica_and_idleness_that_lasts_drains_it():
    deployment = Scripted()
    deployment.passes(4, num_queued=3)  # the window starts, then 2 s of pressure
    assert [(name, n) for name, n, _ in deployment.scaled] == [("decode", 2)]
    assert deployment.scaled[0][2].startswith("queue: 3 request(s) wait for decode room")
    deployment.passes(8, num_queued=3)  # at max now: held once, counted once
    deployment.passes(8)  # nothing queued, nothing measured, 10% KV: idle
    assert [(name, n) for name, n, _ in deployment.scaled] == [("decode", 2), ("decode", 1)]
    state = deployment.published[-1]
    assert state["decisions"] == [
        ["decode", "down", "idle", 1],
        ["decode", "held", "at_max", 1],
        ["decode", "up", "queue", 1],
    ]
    assert state["desired"] == state["actual"] == {"decode": 1}
    status = deployment.planner.status()["decode"]
    assert (status["min_replicas"], status["max_replicas"], status["desired_replicas"]) == (1, 2, 1)
    assert status["decision"]["direction"] in ("hold", "down") and status["error"] is None


def test_latency_from_before_the_window_does_not_count():
    deployment = Scripted()
    slow = buckets(0, 0, 0, 0, 50)  # 50 gaps over 0.5 s: far over any ITL SLO
    deployment.config = parse_config(
        {"decode": {"autoscale": {**AUTOSCALE, "max_replicas": 2}, "slo": {"itl_ms": 50}}}
    )
    deployment.passes(8, itl=slow)  # the first pass starts the window; no new gap since
    assert deployment.scaled == []
    assert deployment.planner.status()["decode"]["observed"]["itl_ms"] is None


def test_an_up_that_does_not_fit_is_held_says_why_and_asks_rays_autoscaler_once():
    deployment = Scripted(room="they need CPU 0.5, and the Ray cluster has CPU 2 in all", max_replicas=3)
    deployment.passes(10, num_queued=2)
    assert deployment.scaled == [] and deployment.asked == ["decode"]
    status = deployment.planner.status()["decode"]
    assert status["decision"]["reason"] == "does_not_fit"
    assert "one more does not fit: they need CPU 0.5" in status["decision"]["detail"]
    assert deployment.published[-1]["decisions"] == [["decode", "held", "does_not_fit", 1]]
    deployment.room = None  # a node arrived
    deployment.passes(1, num_queued=2)
    assert [n for _, n, _ in deployment.scaled] == [2]
    assert deployment.asked == ["decode", None]  # the request replaced by what the deployment now wants


def test_nothing_is_judged_while_the_gateway_cannot_say_the_load():
    deployment = Scripted()
    deployment.pool.members.append(Member(kind="decode", index=1))
    deployment.pool.replicas = 2
    deployment.next_report = RuntimeError("the gateway is down")
    for _ in range(10):
        with pytest.raises(RuntimeError):
            asyncio.run(deployment.planner.pass_once())
        deployment.now_s += 1
    assert deployment.scaled == [] and deployment.published == []


def test_a_pool_in_the_middle_of_a_change_is_not_judged():
    deployment = Scripted()
    deployment.pool.replicas = 2  # an apply is adding one
    deployment.passes(10, num_queued=5)
    assert deployment.scaled == []


def test_the_bundles_asked_for_are_everything_the_deployment_wants_with_one_more():
    deployment = Scripted()
    deployment.pool.spec = SimpleNamespace(bundle={"CPU": 0.5}, labels={"node-type": "big"})  # type: ignore[assignment]
    roster = Roster(pools={"prefill": deployment.prefill, "decode": deployment.pool})
    roster.stores["node-1"] = Member(kind="store", index=0)
    bundles = wanted_bundles(deployment.config, roster, {"decode": 1})
    # prefill 1, decode 1 + 1, the gateway, one store
    assert [shape for shape, _ in bundles] == [
        {"CPU": 0.5},
        {"CPU": 0.5},
        {"CPU": 0.5},
        {"CPU": 0.25},
        {"CPU": 0.25},
    ]
    assert [labels for _, labels in bundles] == [{}, {"node-type": "big"}, {"node-type": "big"}, {}, {}]


def test_window_percentiles_interpolate_in_the_bucket_and_restart_with_a_restarted_gateway():
    window = difference(buckets(10, 10, 0, 0, 0), None)
    assert quantile(window, 50) == pytest.approx(0.01)
    assert quantile(window, 75) == pytest.approx(0.03)
    assert quantile(difference(buckets(0, 0, 0, 0, 0), None), 90) is None
    assert quantile(difference(buckets(0, 0, 0, 0, 4), None), 90) == pytest.approx(0.5)  # at least
    restarted = difference(buckets(1, 0, 0, 0, 0), buckets(5, 5, 0, 0, 0))
    assert restarted[-1][1] == 1


def test_a_prefill_pools_occupancy_is_its_backlog_over_its_batch_tokens():
    view = GatewayView.of(
        [
            {"prefill": {"a:1": {"num_outstanding_prompt_tokens": 1024}}},
            {
                "prefill": {
                    "a:1": {"num_outstanding_prompt_tokens": 1024},
                    "b:1": {"num_outstanding_prompt_tokens": 0},
                }
            },
        ]
    )
    seen = observe("prefill", view, None, 2, SloConfig(), 1024)
    assert seen.occupancy == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"autoscale": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas (3) is above max_replicas (2)"),
        (
            {"replicas": 5, "autoscale": {"max_replicas": 2}},
            "replicas (5) lies outside autoscale's bounds (1..2)",
        ),
        ({"slo": {"itl_ms": 50}}, "slo is read only by the autoscaler"),
        ({"autoscale": {"min_replicas": 0}}, "decode.autoscale.min_replicas: must be at least 1"),
        ({"autoscale": {"target_occupancy": 1.5}}, "target_occupancy"),
    ],
)
def test_autoscale_configs_that_cannot_work_are_refused_with_the_reason(pool, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        parse_config({"decode": pool})


def test_an_autoscaled_pool_starts_at_min_replicas_unless_told_otherwise():
    assert parse_config({"decode": {"autoscale": {"min_replicas": 2}}}).decode.replicas == 2
    assert parse_config({"decode": {"replicas": 3, "autoscale": {"min_replicas": 2}}}).decode.replicas == 3
    # a prefill pool that falls back to decode_local may scale to none
    assert parse_config({"prefill": {"autoscale": {"min_replicas": 0}}}).prefill.replicas == 0
