#!/usr/bin/env bash
# Fills a wheelhouse for `scripts/gpu_check.sh --wheelhouse DIR` on a GPU machine with no network: the
# Python packages a device machine of this workplace lacks (its image's list: /work/.library/device/
# KINDS.md; it has torch, triton, numpy, safetensors, tokenizers, einops, pytest, an older transformers),
# as wheels for CPython 3.12 on x86-64 Linux, pinned to versions seen working there or in the project's
# venv. Run it where PyPI answers:
#   scripts/gpu_wheelhouse.sh DIR              # the device check's stages: ~20 MB
#   scripts/gpu_wheelhouse.sh DIR --cluster    # also what `splitserve up` needs (ray alone is 79 MB,
#                                              # more than the device tool carries: 64 MiB a call)
set -euo pipefail
dir="${1:?usage: scripts/gpu_wheelhouse.sh DIR [--cluster]}"
wheels=(
  fla-core==0.6.0                 # flash-linear-attention: KDA on CUDA (pure Python; needs einops, there)
  transformers==5.24.0            # kimi_linear with fla's kernels; 5.25 wants huggingface-hub>=2.4 (it has 1.33)
  grpcio==1.85.3                  # the generated stubs check the runtime version (engine -> state codec -> rpc)
  grpcio-health-checking==1.85.1
  protobuf==7.36.2
)
if [ "${2:-}" = --cluster ]; then
  wheels+=(ray==2.60.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" "${wheels[@]}"
ls -l "$dir"
