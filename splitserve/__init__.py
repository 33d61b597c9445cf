"""splitserve: disaggregated prefill/decode serving for Kimi-Linear hybrid models.

`import splitserve` stays torch-free; the engine (and with it torch) loads on first use of `LLM`.
"""

from typing import TYPE_CHECKING, Any

from splitserve.outputs import CompletionOutput, RequestOutput
from splitserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from splitserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
