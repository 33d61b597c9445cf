"""The store-scale micro-benchmark runs end to end at a small size, both "before" and "after"."""

from __future__ import annotations

import pytest

from experiments.prefix_store_scale import main, measure


@pytest.mark.parametrize("summing", [True, False])
def test_a_full_store_evicts_one_retained_key_per_register(summing: bool) -> None:
    # measure() itself checks the count stays at num_keys and each register evicted one
    timings = measure(num_keys=20, chunks_per_key=4, chunk_bytes=64, num_calls=5, summing=summing)
    assert set(timings) == {"stats_us", "register_us"} and all(t >= 0 for t in timings.values())


def test_the_table_has_a_row_per_count(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--keys", "5,10", "--calls", "2", "--chunks-per-key", "2", "--chunk-bytes", "32"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["5", "10"]
