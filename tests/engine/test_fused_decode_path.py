"""The whole CUDA code path of the model, run on the CPU: every Triton backend forced (paged MLA, fused
MoE, the fused glue kernels) and interpreted (TRITON_INTERPRET=1), the tiny model in fp32 generates
the same greedy tokens as the torch references, with log-probabilities within 1e-4. This checks what
the kernel tests cannot: the layers' glue around the kernels (layouts, strides, which rows go where).
fla does not run on a CPU, so the KDA recurrence itself stays on its torch reference here."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.triton_interpreted import interpreted

_BACKENDS = ("SPLITSERVE_MLA_BACKEND", "SPLITSERVE_MOE_BACKEND", "SPLITSERVE_FUSED_BACKEND")


def generate_both_ways() -> dict[str, list[list[float]]]:
    """Greedy tokens and their log-probabilities, torch backends then Triton ones, for three prompts."""
    import torch

    from splitserve import LLM, SamplingParams
    from splitserve.tiny_model import make_tiny_model

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    found: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as where:
        path = make_tiny_model(where, seed=0)
        for backend in ("torch", "triton"):
            os.environ.update(dict.fromkeys(_BACKENDS, backend))
            llm = LLM(model=str(path), dtype="float32", max_model_len=128)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            found[f"{backend}_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            found[f"{backend}_logprobs"] = [
                [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])] for o in outs
            ]
    return found


def test_the_cuda_code_path_interpreted_gives_the_torch_tokens():
    pytest.importorskip("triton")
    found = interpreted("tests.engine.test_fused_decode_path", "generate_both_ways")
    assert found["triton_tokens"] == found["torch_tokens"]
    for got, want in zip(found["triton_logprobs"], found["torch_logprobs"]):
        assert len(got) == len(want) == 6
        assert all(abs(g - w) <= 1e-4 for g, w in zip(got, want)), (got, want)
