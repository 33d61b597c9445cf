"""The engine imports no gRPC: what publishes and fetches state over the store's gRPC lives with
the workers (`splitserve/worker/prefix_store/`, the worker packages). A child interpreter whose
import system refuses `grpc` imports every module of `splitserve.engine`, builds an `LLMEngine`
and runs `LLM.generate` on the tiny model; before the move, `state_codec` (and so the prefix
publisher and fetcher) failed to import there, which kept the GPU tests from being collected.
"""

from __future__ import annotations

import json

from tests.python_process import run_python

_CHILD = """
import importlib, json, pkgutil, sys

class RefuseGrpc:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("grpc", "grpc_health", "grpc_tools"):
            raise ModuleNotFoundError(f"{{name}} is refused in this test", name=name)
        return None

sys.meta_path.insert(0, RefuseGrpc())
import splitserve.engine as engine
modules = [info.name for info in pkgutil.walk_packages(engine.__path__, "splitserve.engine.")]
for name in modules:
    importlib.import_module(name)

from splitserve import LLM, SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig

LLMEngine(EngineConfig(model={model!r}, max_model_len=128))
out = LLM(model={model!r}, max_model_len=128).generate(
    "the engine alone", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
)
grpc_loaded = sorted(m for m in sys.modules if m.split(".")[0] == "grpc")
print(json.dumps({{"modules": len(modules), "tokens": out[0].outputs[0].token_ids, "grpc": grpc_loaded}}))
"""


def test_the_engine_and_the_offline_llm_run_without_grpc(tiny_model_path):
    report = json.loads(run_python(_CHILD.format(model=str(tiny_model_path)), timeout_s=300).splitlines()[-1])
    assert report["modules"] > 50  # every engine module was imported, not just the package
    assert len(report["tokens"]) == 3
    assert report["grpc"] == []
