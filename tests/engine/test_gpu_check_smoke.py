"""The device check (scripts/gpu_check.sh) without a device: its quick run end to end on the CPU in
smoke mode (every stage's Python on the tiny model), one JSON line per stage and the summary table
last; a stage past its limit is recorded as such and the next one still runs; the cluster stage
checks and plans its config (it starts a deployment only on a GPU); the stages only the full run has, each in smoke mode; the
budgets fit the issue's windows; and the decode bound's arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from experiments import gpu_mixed, gpu_ready, gpu_throughput, gpu_vs_transformers
from experiments.gpu_common import checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
QUICK = ["install", "device", "checkpoint", "launches", "decode", "long"]


def run_check(*args: str, out: Path, limits: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITSERVE_GPU_LIMITS": limits}
    env.pop("SPLITSERVE_GPU_STAGES", None)
    return subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )


def stage_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_the_quick_check_runs_each_stage_on_the_cpu_and_prints_its_table_last(tmp_path):
    done = run_check("--quick", out=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = stage_lines(tmp_path)
    assert [line["stage"] for line in lines] == QUICK
    assert {line["status"] for line in lines} == {"ok"}, lines
    figures = {line["stage"]: line["figures"] for line in lines}
    assert figures["launches"]["decode"]["1"]["launches"] > 0
    assert figures["decode"]["engine"]["batches"]["1"]["prefill_tok_s"] > 0
    long = figures["long"]["prompts"]
    assert [p["tokens"] for p in long] == [96, 160] and all(len(p["chunks"]) >= 3 for p in long)
    tail = done.stdout.rstrip().splitlines()
    table_at = max(i for i, text in enumerate(tail) if text == "== gpu_check summary")
    assert [text.split()[0] for text in tail[table_at + 2 : table_at + 2 + len(QUICK)]] == QUICK
    assert tail[-1].startswith(f"{len(QUICK)} stages in ")
    # the device tool brings back 8 files of OUT at most: the lines, the log (and here the tiny model)
    assert {p.name for p in tmp_path.iterdir()} == {"gpu_check.jsonl", "gpu_check.log", "model-tiny"}


def test_a_stage_past_its_limit_is_recorded_and_the_next_still_runs(tmp_path):
    done = run_check("--stages", "long cluster", out=tmp_path, limits="long=3")
    assert done.returncode == 1
    long, cluster = stage_lines(tmp_path)
    assert (long["stage"], long["status"], long["limit_s"]) == ("long", "timeout", 3.0)
    # smoke: the cluster stage checks and plans deploy/configs/gpu-one.yaml and starts nothing
    assert cluster["status"] == "ok", cluster
    assert cluster["figures"] == {"config_check": "ok", "config_plan": "ok"}


def test_the_budgets_fit_four_and_eight_minutes_and_quick_has_its_stages(tmp_path):
    for flag, window_s, stages in (("--quick", 240, QUICK), ("", 480, None)):
        plan = run_check("--dry-run", *([flag] if flag else []), out=tmp_path).stdout.splitlines()
        budget_s = int(plan[0].split("budget ")[1].split(" s")[0])
        assert budget_s < window_s
        if stages:
            assert [text.split()[1] for text in plan[1:]] == stages
    assert not (tmp_path / "gpu_check.jsonl").exists()  # a dry run runs nothing


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    where = tmp_path_factory.mktemp("gpu-check-tiny")
    return str(checkpoint(str(where), tiny=True, scratch=where))


@pytest.mark.parametrize(
    ("module", "extra", "figure"),
    [
        (gpu_mixed, [], "itl_during"),
        (gpu_ready, [], "first_over_steady"),
        (gpu_vs_transformers, ["--batch-sizes", "1,2"], "batches"),
        (gpu_throughput, ["--kernels-only", "--batch-sizes", "1,2"], "mla_prefill_tiles"),
    ],
    ids=["mixed", "ready", "hf", "kernels"],
)
def test_a_full_run_stage_writes_its_figures_in_smoke_mode(module, extra, figure, tiny_checkpoint, tmp_path):
    out = tmp_path / "figures.json"
    args = ["--device", "cpu", "--tiny", "--model-dir", tiny_checkpoint, "--json", str(out), *extra]
    assert module.main(args) == 0
    written = json.loads(out.read_text())
    assert written["summary"] and figure in written["figures"]


def test_decode_bound_counts_weights_and_caches():
    torch = pytest.importorskip("torch")

    class Config:
        num_local_experts, num_experts_per_tok = 4, 1
        layer_types = ["linear_attention", "full_attention"]
        kv_lora_rank, qk_rope_head_dim, linear_num_heads, linear_head_dim = 8, 4, 2, 4

    model = torch.nn.Module()
    model.config = Config()  # type: ignore[assignment]
    model.dense = torch.nn.Linear(10, 10, bias=False)  # 100 fp32 = 400 bytes, always read
    batch, context = 1, 5
    kv = 1 * batch * context * (8 + 4) * 4
    state = 1 * batch * 2 * 4 * 4 * 4 * 2
    assert gpu_throughput.decode_step_bytes(model, batch, context) == 400 + kv + state
