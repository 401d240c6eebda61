#!/usr/bin/env bash
# Validate the simulator on a CUDA machine, offline, in under 8 minutes: real probe steps of a configuration
# matrix next to the simulator's prediction -> profiles/measurements/<gpu>.json, then the GPU tests. On a machine with
# several GPUs (nvidia-smi -L) it also probes one small FSDP2 case on 2 GPUs and, with more than 2, on all of them,
# per rank (accelerate launch --num_processes N), into the same JSON's "multi_gpu_rows" (one case each: ~1 minute).
# Online RL (issue 23): one GRPO case with transformers' generate and, where `import vllm` works, one with colocated
# vLLM without and one with sleep mode (the real GRPOTrainer.train() next to the simulation) into "online_rows".
#
#   scripts/gpu_validate.sh [WHEEL_DIR] [gpu_validate.py args...]     (or WHEELS=/path scripts/gpu_validate.sh)
#
# With a wheel folder it first installs what the machine lacks, without the network:
#   pip install --no-index --find-links WHEEL_DIR trl datasets optuna   (only those not importable)
#   pip install --no-deps -e .                                           (the project itself)
#
# Build the wheel folder on a machine with internet, for the GPU machine's Python (e.g. 3.11 on x86_64):
#   scripts/gpu_validate.sh --build-wheels WHEEL_DIR [PY_VERSION]
# which runs
#   pip download --only-binary=:all: --python-version PY --platform manylinux2014_x86_64 -d WHEEL_DIR \
#       trl datasets optuna   (at the versions pinned in constraints.txt)
#   pip wheel --no-deps -w WHEEL_DIR .
# (torch, transformers, accelerate, peft and their dependencies are expected on the GPU image already; pip
# downloads whatever else trl, datasets and optuna need.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if [[ "${1:-}" == "--build-wheels" ]]; then
    dir=${2:?--build-wheels WHEEL_DIR [PY_VERSION]}
    pyver=${3:-$($PY -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')}
    mkdir -p "$dir"
    $PY -m pip download --only-binary=:all: --python-version "$pyver" --platform manylinux2014_x86_64 \
        -d "$dir" $(grep -E '^(trl|datasets|optuna)==' constraints.txt)
    $PY -m pip wheel --no-deps -w "$dir" .
    exit 0
fi

wheels=${WHEELS:-}
if [[ $# -gt 0 && -d "$1" ]]; then
    wheels=$1
    shift
fi

missing=()
for mod in trl datasets optuna; do
    $PY -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [[ -n "$wheels" ]]; then
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "installing from $wheels: ${missing[*]}"
        $PY -m pip install -q --no-index --find-links "$wheels" "${missing[@]}"
    fi
    $PY -c "import advisor" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e .
elif [[ ${#missing[@]} -gt 0 ]]; then
    echo "missing: ${missing[*]}; give a wheel folder (argument or \$WHEELS), see the header of $0" >&2
    exit 2
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
multi=()
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${ngpu:-0} -gt 1 ]]; then
    multi=(--multi-gpu 2)
    [[ $ngpu -gt 2 ]] && multi+=("$ngpu")
    echo "gpu_validate: $ngpu GPUs: also FSDP2 on ${multi[*]:1} ranks"
fi
$PY scripts/gpu_validate.py "$@" ${multi[@]+"${multi[@]}"}
$PY -m pytest -q -m gpu tests/
echo "gpu_validate: done in $(( $(date +%s) - start )) s"
