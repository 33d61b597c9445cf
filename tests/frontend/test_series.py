"""frontend/series.py: the children found by one lookup are the library's, through remove too."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from frontend.series import Counter


def test_children_are_the_librarys_and_follow_remove():
    counter = Counter(
        "splitserve_test_total", "a test series", ["model_name", "route"], registry=CollectorRegistry()
    )
    first = counter.labels("m", "/v1/completions")
    assert counter.labels("m", "/v1/completions") is first  # found, not made again
    assert counter.labels(model_name="m", route="/v1/completions") is first  # the library's own lookup agrees
    first.inc()
    counter.remove("m", "/v1/completions")
    again = counter.labels("m", "/v1/completions")
    assert again is not first and again._value.get() == 0  # a removed child is not handed out again
    assert counter.labels(1, 2) is counter.labels("1", "2")  # values that are not strings: the library's path
