"""The checked-in generated protobuf/gRPC modules match what `python -m proto.generate` makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proto import generate

pytest.importorskip("grpc_tools")


def test_checked_in_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    checked_in = {p.name: p.read_bytes() for p in generate.PROTO_DIR.glob("*_pb2*.py*")}
    assert fresh, "protoc generated nothing"
    assert sorted(fresh) == sorted(checked_in), "generated file set differs; run `python -m proto.generate`"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"{stale} out of date with the .proto files; run `python -m proto.generate`"


def test_every_proto_has_its_messages_and_services_importable_as_the_proto_package() -> None:
    from proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, store_pb2_grpc

    assert common_pb2.StateChunk.DESCRIPTOR.full_name == "splitserve.v1.StateChunk"
    assert hasattr(store_pb2_grpc, "StateStoreServicer")
    assert hasattr(prefill_pb2_grpc, "PrefillServicer")
    assert hasattr(decode_pb2_grpc, "DecodeServicer")


def test_generated_modules_import_without_torch() -> None:
    code = (
        "import sys\n"
        "from proto import common_pb2, prefill_pb2_grpc, decode_pb2_grpc, store_pb2_grpc\n"
        "assert 'torch' not in sys.modules, 'importing the protos loaded torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=generate.REPO_ROOT)


def test_sampling_params_message_has_every_field_of_the_dataclass() -> None:
    import dataclasses

    from proto import common_pb2
    from splitserve.sampling_params import SamplingParams

    proto_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    dataclass_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert proto_fields == dataclass_fields
    optional = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields if f.has_presence}
    assert optional == {"seed", "max_tokens", "logprobs"}
