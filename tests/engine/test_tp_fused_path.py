"""The CUDA code path at a rank's shapes, run on the CPU: a 2-rank engine with every Triton backend forced
and interpreted (TRITON_INTERPRET=1, inherited by the rank processes) gives the greedy tokens of its
torch references, with tensor-parallel experts (the shared MLP fused into the routed GEMMs at the cut
width) and with expert parallelism (other ranks' choices skipped by the grouped GEMMs, the shared MLP
apart). The kernels see what a GPU rank would: a quarter of the heads, a cut MLP, some experts."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.triton_interpreted import interpreted

_BACKENDS = ("SPLITSERVE_MLA_BACKEND", "SPLITSERVE_MOE_BACKEND", "SPLITSERVE_FUSED_BACKEND")


def generate_on_two_ranks() -> dict[str, list[list[float]]]:
    """Greedy tokens and logprobs per (expert_parallel, backend) on two ranks, for two prompts."""
    import torch

    from splitserve import LLM, SamplingParams
    from splitserve.tiny_model import make_tiny_model

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (4, 21)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    found: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as where:
        path = make_tiny_model(where, seed=0)
        for expert_parallel in (False, True):
            for backend in ("torch", "triton"):
                os.environ.update(dict.fromkeys(_BACKENDS, backend))  # the ranks start with this env
                llm = LLM(
                    model=str(path),
                    dtype="float32",
                    max_model_len=64,
                    tensor_parallel_size=2,
                    expert_parallel=expert_parallel,
                )
                try:
                    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                finally:
                    llm.shutdown()
                key = f"ep{int(expert_parallel)}_{backend}"
                found[f"{key}_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
                found[f"{key}_logprobs"] = [
                    [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
                    for o in outs
                ]
    return found


def test_the_cuda_code_path_at_rank_shapes_gives_the_torch_tokens():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_tp_fused_path", "generate_on_two_ranks")
    for ep in ("ep0", "ep1"):
        assert found[f"{ep}_triton_tokens"] == found[f"{ep}_torch_tokens"], ep
        for got, want in zip(found[f"{ep}_triton_logprobs"], found[f"{ep}_torch_logprobs"]):
            assert len(got) == len(want) == 4
            assert all(abs(g - w) <= 1e-4 for g, w in zip(got, want)), (ep, got, want)
