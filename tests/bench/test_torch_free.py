"""The benchmark drives servers over HTTP only: none of it imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_bench_package_and_its_cli_never_import_torch():
    code = (
        "import sys\n"
        "import splitserve.bench.runner, splitserve.bench.serve, splitserve.bench.cli, splitserve.bench.metrics\n"
        "import splitserve.bench.datasets, splitserve.bench.report, splitserve.bench.tokenizer\n"
        "import splitserve.cli\n"
        "splitserve.cli.build_parser().parse_args(['bench', 'serve', '--base-url', 'u', '--model', 'm'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
