"""The eager step's host side: no host sync in the forward of a mixed batch on the CUDA code paths, the
step's indices built per row (not per token) and sent to the device in one copy, and the same batch as
the token-by-token construction it replaced.

Checked on the CPU as tests/engine/test_cuda_graph_safety.py does: under FakeTensorMode any `.item()`,
`.tolist()`, `nonzero` or boolean-mask index raises; the Triton launches and fla's kernels are stubbed
(the torch code around them runs)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from splitserve import LLM, SamplingParams
from splitserve.engine import host_pack
from splitserve.engine.forward_batch import TokenGroup
from splitserve.engine.model import kda as kda_layer
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledRequest
from tests.engine.kernel_stubs import stub_triton_kernels

pytest.importorskip("triton")  # the kernels' Python wrappers import it

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def runner(tiny_model_path) -> ModelRunner:
    return LLM(model=str(tiny_model_path), dtype="float32", max_model_len=512).engine.runner


@pytest.fixture
def device_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The arguments of every host-to-device copy (`Tensor.to` naming a device, or the pinned
    `to_device` a `HostPack` sends through, which on the CPU calls no `to`), until the test ends."""
    copies: list[tuple[Any, ...]] = []
    to = torch.Tensor.to
    pack_to_device = host_pack.to_device

    def counting_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(isinstance(a, torch.device) for a in (*args, *kwargs.values())):
            copies.append(args)
        return to(self, *args, **kwargs)

    def counting_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append((device,))
        return pack_to_device(tensor, device)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    monkeypatch.setattr(host_pack, "to_device", counting_to_device)
    return copies


def _request(i: int, num_tokens: int, num_computed: int, slot: int, first_block: int) -> Request:
    request = Request(f"r{i}", [3 + (7 * i + j) % 500 for j in range(num_tokens)], SamplingParams(), 4, i)
    request.num_computed_tokens, request.state_slot = num_computed, slot
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    request.block_table = list(range(first_block, first_block + num_blocks))[::-1]  # scattered, not in order
    return request


def _mixed_step() -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """Two decodes, then prefill chunks of different lengths (one a request's second chunk)."""
    singles = [ScheduledRequest(_request(0, 21, 20, 0, 0), 1), ScheduledRequest(_request(1, 4, 3, 1, 2), 1)]
    multis = [
        ScheduledRequest(_request(2, 40, 0, 2, 3), 40),
        ScheduledRequest(_request(3, 70, 32, 3, 6), 30),  # tokens 32..61 of 70: samples nothing
        ScheduledRequest(_request(4, 5, 0, 4, 11), 5),
    ]
    return singles, multis


def _cuda_paths_stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_triton_kernels(monkeypatch)

    def fla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> Any:
        return torch.zeros_like(v), rest[-1].clone()

    def fla_decode_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor:
        return torch.zeros_like(v)

    monkeypatch.setattr(kda_layer, "kda_backend", lambda device: "fla")
    monkeypatch.setattr(kda_layer, "kda_prefill", fla_prefill)
    monkeypatch.setattr(kda_layer, "kda_decode_into", fla_decode_into)


@torch.inference_mode()
def test_mixed_step_forward_has_no_host_sync_on_the_cuda_paths(runner, monkeypatch):
    _cuda_paths_stubbed(monkeypatch)
    singles, multis = _mixed_step()
    batch = runner.build_batch(singles, multis)
    assert batch.multi is not None and batch.multi.valid_index is not None  # ragged: gathers, no mask
    with FakeTensorMode(allow_non_fake_inputs=True):
        hidden = runner.model(batch, runner.caches)
    assert tuple(hidden.shape) == (4, runner.model.config.hidden_size)  # 2 decodes, 2 last chunks sample


def test_a_step_sends_its_indices_to_the_device_in_one_copy(runner, device_copies):
    runner.build_batch(*_mixed_step())
    assert len(device_copies) == 1


def _reference_group(rows: list[tuple[int, int, list[int], int]], offset: int) -> dict[str, torch.Tensor]:
    """The token group as the runner built it before, all on the host: rows of (computed, new, table, slot)."""
    lengths = [n for _, n, _, _ in rows]
    computed = torch.tensor([c for c, _, _, _ in rows])
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0) + offset
    steps = torch.arange(max(lengths))
    len_t = torch.tensor(lengths)
    valid = steps.unsqueeze(0) < len_t.unsqueeze(1)
    max_ctx = int((computed + len_t).max())
    tables = torch.zeros(len(rows), -(-max_ctx // BLOCK_SIZE), dtype=torch.long)
    for i, (_, _, table, _) in enumerate(rows):
        table = table[: tables.shape[1]]
        tables[i, : len(table)] = torch.tensor(table)
    positions = torch.arange(max_ctx)
    return {
        "token_index": torch.where(valid, starts.unsqueeze(1) + steps, 0),
        "valid": valid,
        "kv_index": tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        "query_pos": computed.unsqueeze(1) + steps,
        "state_slots": torch.tensor([s for _, _, _, s in rows]),
    }


def _check_group(group: TokenGroup, rows: list[tuple[int, int, list[int], int]], offset: int) -> None:
    for name, want in _reference_group(rows, offset).items():
        assert torch.equal(getattr(group, name), want), name
    assert torch.equal(group.real_token_index(), group.token_index[group.valid])
    assert group.starts == group.token_index[:, 0].tolist()


def test_build_batch_equals_the_token_by_token_construction(runner):
    rng = random.Random(0)
    for trial in range(20):
        singles, multis, block = [], [], 0
        for i in range(rng.randint(0, 4)):
            n = rng.randint(1, 60)
            singles.append(ScheduledRequest(_request(i, n, n - 1, i, block), 1))
            block += 4
        for i in range(rng.randint(0 if singles else 1, 4)):
            n = rng.randint(2, 90)
            done = rng.choice([0, rng.randint(0, n - 2)])
            multis.append(
                ScheduledRequest(_request(10 + i, n, done, 10 + i, block), rng.randint(2, n - done))
            )
            block += 6
        batch = runner.build_batch(singles, multis)
        ids, kv_rows, sampled = [], [], []
        for s in singles + multis:
            req = s.request
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
                ids.append(req.token_at(pos))
                kv_rows.append(req.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            if s.samples:
                sampled.append(len(ids) - 1)
        assert batch.input_ids.tolist() == ids, trial
        assert batch.slot_mapping.tolist() == kv_rows, trial
        assert batch.logits_indices.tolist() == sampled, trial

        for scheduled, group, offset in ((singles, batch.single, 0), (multis, batch.multi, len(singles))):
            if not scheduled:
                assert group is None
                continue
            assert group is not None
            spec = [
                (
                    s.request.num_computed_tokens,
                    s.num_new_tokens,
                    s.request.block_table,
                    s.request.state_slot or 0,
                )
                for s in scheduled
            ]
            _check_group(group, spec, offset)


def test_request_token_ids_slices_prompt_and_outputs():
    request = Request("r", [5, 6, 7], SamplingParams(), 4, 0, output_token_ids=[8, 9])
    for start in range(6):
        for stop in range(start, 6):
            assert request.token_ids(start, stop) == [request.token_at(p) for p in range(start, stop)]


def test_graph_load_fills_the_static_buffers_in_one_copy(tiny_model_path, device_copies):
    from splitserve.engine.cuda_graph import DecodeGraphs

    engine = LLM(
        model=str(tiny_model_path), dtype="float32", max_model_len=256, pad_decode_batches=True
    ).engine
    assert engine.padding is not None
    scratch_block, scratch_slot = engine.padding.scratch_block, engine.padding.scratch_slot
    graphs = DecodeGraphs(engine.model, engine.caches, engine.padding, BLOCK_SIZE, 256, torch.device("cpu"))
    requests = [_request(0, 21, 20, 0, 0), _request(1, 4, 3, 1, 2), _request(2, 41, 40, 2, 3)]
    graphs.load(requests, 4)  # three rows and one padding row
    assert len(device_copies) == 1
    assert graphs.input_ids[:4].tolist() == [r.token_at(r.num_computed_tokens) for r in requests] + [0]
    assert graphs.positions[:4].tolist() == [20, 3, 40, 0]
    assert graphs.slots[:4].tolist() == [0, 1, 2, scratch_slot]
    width = 3  # blocks of the longest context, 41 tokens
    want = [(r.block_table + [scratch_block] * width)[:width] for r in requests] + [[scratch_block] * width]
    assert graphs.block_tables[:4, :width].tolist() == want
