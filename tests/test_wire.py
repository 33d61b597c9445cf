"""Sampling parameters survive the wire unchanged, defaults included."""

from __future__ import annotations

import pytest

from splitserve.sampling_params import SamplingParams
from splitserve.v1 import common_pb2
from splitserve.wire import (
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_tokens=None, logprobs=0),
        SamplingParams(n=3, best_of=5, seed=9),
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            seed=2**62,
            max_tokens=77,
            min_tokens=3,
            stop=["\n\n", "END"],
            stop_token_ids=[5, 9],
            ignore_eos=True,
            logprobs=5,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
    ],
)
def test_sampling_params_round_trip(params):
    wire = sampling_params_to_proto(params).SerializeToString()
    back = sampling_params_from_proto(common_pb2.SamplingParams.FromString(wire))
    assert back == params


def test_bad_values_from_the_wire_are_rejected():
    msg = sampling_params_to_proto(SamplingParams())
    msg.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_from_proto(msg)


def test_logprobs_round_trip():
    entry = {3: -0.25, 10: -1.5}
    assert logprobs_from_proto(logprobs_to_proto(entry)) == pytest.approx(entry)
