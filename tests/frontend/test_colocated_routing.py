"""In colocated mode each worker prefills what it reserved: its own engine holds the room."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.frontend.conftest import MODEL, running_gateway


def test_with_several_colocated_workers_each_prefill_goes_where_its_reservation_is(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_prefill=3, num_decode=3, colocated=True) as gateway:
        client = gateway.openai()
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda i: client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3), range(12)
                )
            )
        reserved = [{r.request_id for r in d.reserves} for d in gateway.decodes]
        prefilled = [{r.request_id for r in p.requests} for p in gateway.prefills]
    assert sum(map(len, reserved)) == 12
    assert sum(1 for ids in reserved if ids) >= 2, "the router should spread reservations"
    assert prefilled == reserved


def test_disaggregated_pools_still_pick_the_prefill_worker_independently(tiny_model_path, script):
    with running_gateway(tiny_model_path, script, num_prefill=2, num_decode=1) as gateway:
        client = gateway.openai()
        for i in range(4):
            client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3)
        assert all(p.requests for p in gateway.prefills), "both prefill workers should get prompts"
