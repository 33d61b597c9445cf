"""The benchmark drives servers over HTTP only: none of it imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_bench_package_and_its_cli_never_import_torch():
    code = (
        "import sys\n"
        "import splitserve.bench.runner, splitserve.bench.serve, splitserve.bench.cli, splitserve.bench.metrics\n"
        "import splitserve.bench.datasets, splitserve.bench.report, splitserve.bench.tokenizer\n"
        "import splitserve.bench.compare, splitserve.bench.compare_run, splitserve.bench.compare_output\n"
        "import splitserve.bench.compare_table, splitserve.bench.plots, splitserve.bench.deployments\n"
        "import splitserve.cli\n"
        "splitserve.cli.build_parser().parse_args(['bench', 'serve', '--base-url', 'u', '--model', 'm'])\n"
        "splitserve.cli.build_parser().parse_args(['bench', 'compare', '--config', 'c', '--output-dir', 'o'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'ray' not in sys.modules, 'ray was imported'  # bench compare loads it only to start a deployment\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
