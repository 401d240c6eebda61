#!/usr/bin/env bash
# Validate the simulator on a CUDA machine within one GPU lease, offline: install what the image lacks from a wheel
# folder, then scripts/gpu_validate.py (its docstring has the plan): the SFT cases and the GRPO generate case probed
# next to the simulator's predictions, one `advisor suggest --backend cuda --trials 3`, then `pytest -m gpu` bounded
# to 2 minutes; 5 minutes by default after the install (--budget S), each step capped, every row written to the JSON
# as its step ends (a killed run keeps them). With several GPUs (nvidia-smi -L) it adds one FSDP2 case on 2 GPUs
# and, with more, on all of them (--multi-gpu), as the budget allows.
#
#   scripts/gpu_validate.sh [WHEEL_DIR] [gpu_validate.py args...]     (or WHEELS=DIR scripts/gpu_validate.sh ...)
#   scripts/gpu_validate.py --dry-run                                  the plan: each step's planned time and cap
#
# WHEEL_DIR holds wheels of what the machine's image lacks (for the lent H200: the pinned transformers, trl, peft,
# optuna, datasets, SQLAlchemy and the few pure-Python packages they need; torch 2.11, accelerate, nvidia-ml-py and
# pytest are in the image). Make it where pip reaches a registry, from the project root:
#   ../shared/device/prepare.sh              -> .whl/ (about 21 MB, ignored through .git/info/exclude)
# It is installed without the network and without touching the image, and the checkout itself is the project:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE WHEEL_DIR/*.whl
#   export PYTHONPATH=$SITE:$PWD           (SITE defaults to /tmp/site)
#
# On a lent device machine, one call of the device tool's run, from this checkout (timeout_s 360: the 300 s budget,
# the ~15 s install, Python's start and the last step's cleanup; the machine's start comes on top, in the lease):
#   carry:   [".whl"]
#   command: set -o pipefail; PYTHONUNBUFFERED=1 scripts/gpu_validate.sh .whl --out $OUT/h200.json 2>&1 | tee $OUT/gpu_validate.log
# Results: $OUT/h200.json (rows as they finish; "complete": true at the end) and $OUT/gpu_validate.log; the reply's
# output tail ends with the summary table. Copy the JSON to profiles/measurements/h200.json to keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}

wheels=${WHEELS:-}
if [[ $# -gt 0 && -d "$1" ]]; then
    wheels=$1
    shift
fi
if [[ -n "$wheels" ]]; then
    shopt -s nullglob
    found=("$wheels"/*.whl)
    if [[ ${#found[@]} -eq 0 ]]; then
        echo "gpu_validate: no .whl in $wheels; make the folder with ../shared/device/prepare.sh (see $0)" >&2
        exit 2
    fi
    start=$(date +%s)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${found[@]}"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_validate: installed ${#found[@]} wheels from $wheels into $SITE in $(( $(date +%s) - start )) s"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

missing=()
for mod in trl datasets optuna peft; do
    $PY -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "gpu_validate: missing ${missing[*]}; give a wheel folder (argument or \$WHEELS), see the header of $0" >&2
    exit 2
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
multi=()
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${ngpu:-0} -gt 1 ]]; then
    multi=(--multi-gpu 2)
    [[ $ngpu -gt 2 ]] && multi+=("$ngpu")
    echo "gpu_validate: $ngpu GPUs: also FSDP2 on ${multi[*]:1} ranks"
fi
exec $PY scripts/gpu_validate.py "$@" ${multi[@]+"${multi[@]}"}
