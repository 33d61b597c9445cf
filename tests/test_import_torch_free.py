"""`import splitserve` (config, params, tokenizer, detokenizer) never loads torch."""

from __future__ import annotations

from tests.python_process import run_python


def test_core_package_imports_without_torch():
    code = (
        "import sys\n"
        "import splitserve, splitserve.sampling_params, splitserve.engine_config, splitserve.tokenizer\n"
        "import splitserve.detokenizer, splitserve.outputs, cli.main, splitserve.engine.model_config\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run_python(code)


def test_llm_attribute_loads_the_engine_lazily():
    code = "import sys, splitserve\nassert 'torch' not in sys.modules\nsplitserve.LLM\nassert 'torch' in sys.modules\n"
    run_python(code)
