"""The test oracle: transformers' own KimiLinearForCausalLM, and vLLM-style logprob comparison."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class GreedyTrace:
    """One greedy continuation: the tokens and, per token, its top-k `{token_id: logprob}`."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]


def hf_greedy(
    path: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, k: int = 5
) -> list[GreedyTrace]:
    """transformers' generate, one prompt at a time (no padding), EOS suppressed like ignore_eos."""
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    traces = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # a prompt may contain the pad id; nothing is padding
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            tops = []
            for step_logits in out.logits:
                lp = torch.log_softmax(step_logits[0].float(), dim=-1)
                values, ids = lp.topk(k)
                tops.append(dict(zip(ids.tolist(), values.tolist())))
            traces.append(GreedyTrace(tokens, tops))
    return traces


def hf_logits(path: str | Path, prompt: Sequence[int]) -> torch.Tensor:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([list(prompt)])).logits[0].float()


def check_logprobs_close(
    reference: Sequence[GreedyTrace],
    tested: Sequence[GreedyTrace],
    *,
    atol: float = 1e-3,
    min_matching: int = 1,
) -> None:
    """vLLM's rule: tokens must agree until a divergence that each side's top-k explains.

    Where the tokens agree, the logprob of that token must also agree within `atol`. After a
    permitted divergence the comparison of that sequence stops. A sequence must match for at
    least `min_matching` tokens so a broken model cannot pass by diverging at once.
    """
    assert len(reference) == len(tested)
    for i, (ref, got) in enumerate(zip(reference, tested)):
        assert len(got.token_ids) == len(ref.token_ids), f"prompt {i}: lengths differ"
        for pos, (r, g) in enumerate(zip(ref.token_ids, got.token_ids)):
            ref_top, got_top = ref.top_logprobs[pos], got.top_logprobs[pos]
            if r == g:
                assert abs(ref_top[r] - got_top[g]) <= atol, (
                    f"prompt {i} token {pos}: logprob {got_top[g]:.6f} vs transformers {ref_top[r]:.6f}"
                )
                continue
            assert r in got_top and g in ref_top, (
                f"prompt {i} token {pos}: engine chose {g}, transformers {r}, and neither is in the "
                f"other's top-{len(ref_top)} ({sorted(got_top)} / {sorted(ref_top)})"
            )
            assert pos >= min_matching, f"prompt {i} diverged at token {pos}"
            break


def engine_traces(outputs: Sequence, k: int = 5) -> list[GreedyTrace]:  # type: ignore[type-arg]
    traces = []
    for out in outputs:
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        traces.append(GreedyTrace(list(c.token_ids), [dict(lp) for lp in c.logprobs]))
    return traces
