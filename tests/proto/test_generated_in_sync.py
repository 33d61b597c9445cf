"""The checked-in generated protobuf/gRPC modules match what `python proto/generate.py` makes now."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grpc_tools  # noqa: F401  (a dev dependency: a broken install fails here, never skips)

REPO_ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "run `python proto/generate.py`"


def _load_generator():
    """`proto/generate.py` is a script beside the sources, not an importable package."""
    spec = importlib.util.spec_from_file_location(
        "splitserve_proto_generate", REPO_ROOT / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generator()


def test_checked_in_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    checked_in = {p.name: p.read_bytes() for p in generate.generated_files()}
    assert fresh, "protoc generated nothing"
    assert sorted(fresh) == sorted(checked_in), f"generated file set differs; {REGENERATE}"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"{stale} out of date with the .proto files; {REGENERATE}"


def test_the_generator_runs_as_the_documented_command(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "proto/generate.py", "--out", str(tmp_path)], check=True, cwd=REPO_ROOT)
    assert (tmp_path / "splitserve" / "v1" / "decode_pb2_grpc.py").exists()


def test_stubs_live_outside_the_proto_plus_package_name() -> None:
    """proto-plus (installed by Ray's dependencies) owns the top-level name `proto`."""
    from splitserve.v1 import common_pb2

    assert common_pb2.__name__ == "splitserve.v1.common_pb2"
    assert not (REPO_ROOT / "proto" / "__init__.py").exists()


def test_every_proto_has_its_messages_and_services_importable() -> None:
    from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, store_pb2_grpc

    assert common_pb2.StateChunk.DESCRIPTOR.full_name == "splitserve.v1.StateChunk"
    assert hasattr(store_pb2_grpc, "StateStoreServicer")
    assert hasattr(prefill_pb2_grpc, "PrefillServicer")
    assert hasattr(decode_pb2_grpc, "DecodeServicer")


def test_generated_modules_import_without_torch() -> None:
    code = (
        "import sys\n"
        "from splitserve.v1 import common_pb2, prefill_pb2_grpc, decode_pb2_grpc, store_pb2_grpc\n"
        "assert 'torch' not in sys.modules, 'importing the protos loaded torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_sampling_params_message_has_every_field_of_the_dataclass() -> None:
    import dataclasses

    from splitserve.sampling_params import SamplingParams
    from splitserve.v1 import common_pb2

    proto_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    dataclass_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert proto_fields == dataclass_fields
    optional = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields if f.has_presence}
    assert optional == {"seed", "max_tokens", "logprobs", "best_of"}
