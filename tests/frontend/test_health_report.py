"""What /health concludes from what the gateway knows of its workers (frontend/health_report.py)."""

from __future__ import annotations

from frontend.health_report import health_report

P, D1, D2 = "p:1", "d:1", "d:2"


def _report(unreachable=None, idle_held=None, full=frozenset(), fallback="decode_local", **kw):
    return health_report([P], [D1, D2], unreachable or {}, idle_held or {}, set(full), fallback, **kw)


def test_everything_reachable_is_ok():
    report = _report()
    assert (report.status, report.serving, report.prefill_workers, report.decode_workers) == ("ok", True, 1, 2)
    assert report.problems == []


def test_one_decode_worker_down_is_degraded_but_serving():
    report = _report(unreachable={D1: "Connection refused"})
    assert (report.status, report.serving, report.decode_workers) == ("degraded", True, 1)
    assert report.problems == ["worker d:1 is unreachable: Connection refused"]


def test_no_reachable_decode_worker_is_not_serving():
    report = _report(unreachable={D1: "gone", D2: "gone"})
    assert (report.status, report.serving, report.decode_workers) == ("degraded", False, 0)
    assert report.problems[-1] == "no decode worker can take a request"


def test_a_wedged_decode_worker_counts_as_unable_to_take_a_request():
    """No free slot and slots held by nothing it runs or reserved: they will never come back."""
    report = _report(unreachable={D2: "gone"}, idle_held={D1: 16}, full={D1})
    assert (report.serving, report.decode_workers) == (False, 0)
    assert "decode worker d:1 holds 16 state slots with nothing running or reserved" in report.problems


def test_a_full_but_busy_decode_worker_is_not_a_problem():
    report = _report(full={D1, D2})
    assert (report.status, report.serving, report.decode_workers) == ("ok", True, 2)


def test_idle_held_slots_with_room_left_are_reported_but_still_serve():
    report = _report(idle_held={D1: 3})
    assert (report.status, report.serving, report.decode_workers) == ("degraded", True, 2)


def test_no_reachable_prefill_worker_serves_only_through_decode_local():
    local = _report(unreachable={P: "gone"})
    assert (local.status, local.serving, local.prefill_workers) == ("degraded", True, 0)
    fail = _report(unreachable={P: "gone"}, fallback="fail")
    assert (fail.status, fail.serving) == ("degraded", False)


def test_draining_is_not_serving_whatever_the_workers():
    report = _report(draining=True)
    assert (report.status, report.serving) == ("draining", False)


def test_an_empty_pool_is_no_workers():
    report = health_report([P], [], {}, {}, set(), "decode_local")
    assert (report.status, report.serving) == ("no workers", False)
    report = health_report([], [D1], {}, {}, set(), "fail")
    assert (report.status, report.serving) == ("no workers", False)
    assert health_report([], [D1], {}, {}, set(), "decode_local").serving
