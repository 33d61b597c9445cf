"""On CUDA the engine (Triton paged MLA, fla's KDA where installed) gives the CPU engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_tiny_model_on_cuda_gives_the_cpu_tokens(tiny_model_path):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (3, 17, 40, 130)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(device: str) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_path), dtype="float32", device=device, max_model_len=256)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
        return [list(o.outputs[0].token_ids) for o in outs]

    assert tokens("cuda") == tokens("cpu")
