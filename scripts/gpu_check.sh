#!/usr/bin/env bash
# The prepared device check for one CUDA GPU (issue 24): every stage on a cold machine in under 8 minutes,
# `--quick` in under 4. docs/PERFORMANCE.md section 5 has the budget's arithmetic and what each stage prints.
#
#   scripts/gpu_check.sh [--quick] [--stages "decode long"] [--out DIR] [--wheelhouse DIR] [--model-dir DIR]
#   scripts/gpu_check.sh --smoke [--quick]     # every stage's Python on the CPU, tiny shapes (the tests run this)
#   scripts/gpu_check.sh --dry-run [--quick]   # the plan: stages, time limits, commands; runs nothing
#
# Stages, in order (--quick: install device checkpoint launches decode long; decode at batch 1 and 64, long 32k):
#   install     what the GPU path needs: from --wheelhouse (no network: pip --no-index into a folder on
#               PYTHONPATH; scripts/gpu_wheelhouse.sh fills one), else a venv with pip (network), else nothing
#   device      the GPU, torch, triton, fla
#   checkpoint  the ~1B random kimi_linear in bf16, built once into --model-dir
#   launches    kernel launches per decode step and prefill chunk (counted on the CPU)
#   decode      engine tok/s at batch 1/16/64, eager and with CUDA graphs, against the bandwidth bound; load times
#   long        a 32k- and a 128k-token prompt, each chunk timed on the device (MLA, KDA, MLP apart)
#   mixed       inter-token latency of 16 decodes while a 32k prompt prefills
#   ready       a new engine (a restart: caches warm): its load, first TTFT against later ones
#   hf          transformers' generate (with fla) against the engine, batch 1/16/64, one process
#   kernels     each kernel against its torch reference; the MLA prefill kernel's tile shapes at 32k
#   tests       the gpu-marked tests (kernels at real shapes, the tiny model on CUDA, CUDA graphs)
#   cluster     `splitserve up --config deploy/configs/gpu-one.yaml`: greedy tokens against the offline
#               engine, `splitserve bench serve` random 512/128 at concurrency 16 and 64 (skipped, saying
#               why, without Ray: its 79 MB wheel must be in the wheelhouse; --smoke: config check + plan)
# Every stage has a time limit (cut to what the whole run's budget has left) and runs even when an
# earlier one failed; each writes one JSON line to OUT/gpu_check.jsonl (status, seconds, limit, its
# figures), the whole output goes to OUT/gpu_check.log too, and the summary table is printed last.
# The exit status is non-zero when a stage failed or ran out of time.
# Environment: SPLITSERVE_GPU_STAGES, SPLITSERVE_GPU_OUT (default $OUT, else $TMPDIR/splitserve-gpu-check),
# SPLITSERVE_GPU_WHEELHOUSE, SPLITSERVE_GPU_MODEL_DIR, SPLITSERVE_GPU_LIMITS ("long=120 hf=200": other
# stage limits, seconds), SPLITSERVE_GPU_NO_INSTALL=1 (the active python as is), SPLITSERVE_GPU_VENV,
# TORCH_INDEX_URL.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

orig_args=("$@")
quick=0 smoke=0 dry=0 run_stage="" run_figures=""
stages_arg="${SPLITSERVE_GPU_STAGES:-}"
out="${SPLITSERVE_GPU_OUT:-${OUT:-${TMPDIR:-/tmp}/splitserve-gpu-check}}"
wheelhouse="${SPLITSERVE_GPU_WHEELHOUSE:-}"
model_dir="${SPLITSERVE_GPU_MODEL_DIR:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --smoke) smoke=1 ;;
    --dry-run) dry=1 ;;
    --stages) stages_arg="$2"; shift ;;
    --out) out="$2"; shift ;;
    --wheelhouse) wheelhouse="$2"; shift ;;
    --model-dir) model_dir="$2"; shift ;;
    --run-stage) run_stage="$2" run_figures="$3"; shift 2 ;;  # internal: one stage, under its limit
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# The whole run's budget, install included, a little under the issue's 4 and 8 minutes.
if [ "$quick" = 1 ]; then budget_s=225; else budget_s=465; fi
quick_stages="install device checkpoint launches decode long"
full_stages="install device checkpoint launches decode long mixed ready hf kernels tests cluster"
if [ -n "$stages_arg" ]; then stages=" $stages_arg "
elif [ "$quick" = 1 ]; then stages=" $quick_stages "
else stages=" $full_stages "; fi
if [ "$smoke" = 1 ]; then
  dev=(--device cpu --tiny)
  model_dir="${model_dir:-$out/model-tiny}"
else
  dev=(--device cuda)
  model_dir="${model_dir:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/gpu-check-1b}"
fi
if [ "$quick" = 1 ]; then decode_batches=1,64 long_sizes=32768; else decode_batches=1,16,64 long_sizes=32768,131072; fi
if [ "$smoke" = 1 ]; then decode_batches=1,2 long_sizes=96,160; fi
model=(--model-dir "$model_dir")
cluster_config=deploy/configs/gpu-one.yaml

# Each stage: a time limit in seconds (the arithmetic: docs/PERFORMANCE.md section 5) and a command that
# writes its figures to the file named by its last argument.
declare -A limit_s=(
  [install]=60 [device]=30 [checkpoint]=60 [launches]=45 [decode]=150 [long]=90
  [mixed]=60 [ready]=45 [hf]=120 [kernels]=60 [tests]=150 [cluster]=150
)
[ "$quick" = 1 ] && limit_s[long]=60
for pair in ${SPLITSERVE_GPU_LIMITS:-}; do limit_s[${pair%%=*}]=${pair#*=}; done  # e.g. "long=120 hf=200"

install_stage() {
  if [ "$smoke" = 1 ]; then echo "smoke mode: nothing installed"; return 0; fi
  if [ -n "$wheelhouse" ]; then  # no network: the wheels this machine lacks, carried in
    local site="${TMPDIR:-/tmp}/splitserve-gpu-site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$wheelhouse"/*.whl || return 1
    echo "installed $(ls "$wheelhouse"/*.whl | wc -l) wheels from $wheelhouse into $site"
    return 0
  fi
  if [ "${SPLITSERVE_GPU_NO_INSTALL:-0}" = 1 ] || ready_to_run; then echo "nothing to install"; return 0; fi
  # a venv outside the tree; system site packages: a CUDA torch already on the machine is used as is
  local venv="${SPLITSERVE_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/venv-gpu}"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv --system-site-packages "$venv" || return 1
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  echo "ACTIVATE: $venv"  # the stages after this one run in it
  if ! python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
    pip install -q "torch>=2.7" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} || return 1
  fi
  pip install -q -e "$root[engine,gpu,dev]"
}
ready_to_run() {  # everything the check imports is there, with a CUDA torch
  python3 -c "import sys, torch, triton, fla, transformers, safetensors, grpc_health, pytest, pytest_timeout
sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1
}
device_stage() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python3 - "$smoke" <<'PY'
import importlib.util, sys
import torch
smoke = sys.argv[1] == "1"
if not smoke and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this check needs one (or --smoke)")
where = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU (smoke mode)"
found = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
for name in ("triton", "fla", "transformers", "grpc_health"):
    if importlib.util.find_spec(name) is None:
        if not smoke:
            sys.exit(f"{name} is not importable: pass --wheelhouse DIR or pip install -e '.[engine,gpu,dev]'")
        found.append(f"{name} missing")
        continue
    found.append(f"{name} {getattr(__import__(name), '__version__', '')}".strip())
print(f"{where}: " + ", ".join(found))
PY
}
tests_stage() {
  if [ "$smoke" = 1 ]; then  # no GPU: the gpu-marked tests are collected, not run
    python3 -m pytest -q --co -m gpu -p no:cacheprovider tests/engine | tail -1
    return "${PIPESTATUS[0]}"
  fi
  # a test still running after 60 s prints every thread's stack (a hang says where it is)
  python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=10 -o faulthandler_timeout=60 tests/engine
}
cluster_stage() {  # experiments/gpu_cluster.py: exit 3 is "skipped" (no config, no Ray), with the reason
  local smoke_flag=()
  [ "$smoke" = 1 ] && smoke_flag=(--smoke)
  python3 -m experiments.gpu_cluster --config "$cluster_config" "${dev[@]:0:2}" "${smoke_flag[@]}" --json "$1"
}

stage_command() {  # stage_command KEY FIGURES: run stage KEY, its figures to FIGURES
  local key="$1" fig="$2"
  case "$key" in
    install) install_stage ;;
    device) device_stage ;;
    checkpoint) python3 -m experiments.gpu_model "${dev[@]}" "${model[@]}" --json "$fig" ;;
    launches) python3 -m experiments.gpu_launches "${dev[@]}" --batch-sizes 1,64 --json "$fig" ;;
    decode) python3 -m experiments.gpu_throughput "${dev[@]}" "${model[@]}" --engine-only \
      --batch-sizes "$decode_batches" --json "$fig" ;;
    long) python3 -m experiments.gpu_long "${dev[@]}" "${model[@]}" --sizes "$long_sizes" --json "$fig" ;;
    mixed) python3 -m experiments.gpu_mixed "${dev[@]}" "${model[@]}" --json "$fig" ;;
    ready) python3 -m experiments.gpu_ready "${dev[@]}" "${model[@]}" --json "$fig" ;;
    hf) python3 -m experiments.gpu_vs_transformers "${dev[@]}" "${model[@]}" --batch-sizes "$decode_batches" \
      --json "$fig" ;;
    kernels) python3 -m experiments.gpu_throughput "${dev[@]}" --kernels-only --batch-sizes "$decode_batches" \
      --json "$fig" ;;
    tests) tests_stage ;;
    cluster) cluster_stage "$fig" ;;
    *) echo "unknown stage $key" >&2; return 2 ;;
  esac
}

if [ -n "$run_stage" ]; then
  stage_command "$run_stage" "$run_figures"
  exit $?
fi
start_s=$(date +%s)
deadline_s=$((start_s + budget_s))
jsonl="$out/gpu_check.jsonl"
if [ "$dry" = 1 ]; then
  echo "plan: budget ${budget_s} s, out $out, model $model_dir"
  for key in $stages; do echo "stage $key limit ${limit_s[$key]:-?} s"; done
  exit 0
fi
# OUT keeps two files (the device tool brings back at most 8): the stages' lines and the whole log;
# each stage's own log and figures go to a work folder beside it
mkdir -p "$out"
work="$(mktemp -d "${TMPDIR:-/tmp}/splitserve-gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
: >"$jsonl"
exec > >(tee "$out/gpu_check.log") 2>&1
export PYTHONPATH="${TMPDIR:-/tmp}/splitserve-gpu-site:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
failed=0
for key in $stages; do
  limit="${limit_s[$key]:-60}"
  left=$((deadline_s - $(date +%s)))
  fig="$work/$key.figures.json" log="$work/$key.log"
  rm -f "$fig"
  if [ "$left" -lt 15 ]; then
    python3 -m experiments.gpu_check_report record "$jsonl" --stage "$key" --status skipped --limit "$limit" \
      --note "no time left in the run's ${budget_s} s"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $key (limit ${limit} s; $(($(date +%s) - start_s)) s into the run)"
  t0=$(date +%s)
  # this script again, for the one stage: the limit ends it and everything it started
  timeout --kill-after=10 "$limit" bash "$0" "${orig_args[@]}" --run-stage "$key" "$fig" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  seconds=$(($(date +%s) - t0))
  note=""
  case "$rc" in
    0) status=ok ;;
    3) status=skipped note="$(grep -m1 '^SKIP: ' "$log" | cut -c7-)" ;;
    124 | 137) status=timeout note="past its ${limit} s" ;;
    *) status=failed note="exit $rc" ;;
  esac
  if [ "$status" = timeout ] || [ "$status" = failed ]; then failed=1; fi
  python3 -m experiments.gpu_check_report record "$jsonl" --stage "$key" --status "$status" --rc "$rc" \
    --seconds "$seconds" --limit "$limit" --figures "$fig" --log "$log" --note "$note"
  venv="$(grep -m1 '^ACTIVATE: ' "$log" | cut -c11-)"
  # shellcheck disable=SC1091
  if [ -n "$venv" ] && [ "$status" = ok ]; then . "$venv/bin/activate"; fi
done
python3 -m experiments.gpu_check_report table "$jsonl"
exit "$failed"
