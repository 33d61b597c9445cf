"""The benchmark drives servers over HTTP only: none of it imports torch."""

from __future__ import annotations

from tests.python_process import run_python


def test_the_bench_package_and_its_cli_never_import_torch():
    code = (
        "import sys\n"
        "import bench.runner, bench.serve, bench.cli, bench.metrics\n"
        "import bench.datasets, bench.report, bench.tokenizer\n"
        "import bench.compare, bench.compare_run, bench.compare_output\n"
        "import bench.compare_table, bench.plots, bench.deployments\n"
        "import cli.main\n"
        "cli.main.build_parser().parse_args(['bench', 'serve', '--base-url', 'u', '--model', 'm'])\n"
        "cli.main.build_parser().parse_args(['bench', 'compare', '--config', 'c', '--output-dir', 'o'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'ray' not in sys.modules, 'ray was imported'  # bench compare loads it only to start a deployment\n"
    )
    run_python(code)
