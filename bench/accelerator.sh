#!/usr/bin/env bash
# Issue 32 §4: the bench on an accelerator, as one prepared run (the device tool lends a machine
# with PyTorch and JAX's CUDA plugin installed, nothing to fetch). From the repository root:
#   bash bench/accelerator.sh [OUTDIR] [quick]
# It runs the checkout in place (PYTHONPATH, no install) with whatever torch and jax the machine
# has, on PJRT_DEVICE=GPU: the versions and the card; the programs' training against CPU eager
# (bench.agree); the step benchmark against JAX and against PyTorch eager on CUDA (bench.bench);
# whether tracing step N+1 overlaps executing step N (bench.overlap); a sync's host cost
# (bench.sync_cost). Logs go to OUTDIR (default: /tmp/accelerator).
set -u
out=${1:-/tmp/accelerator}
mkdir -p "$out"
[ -e xlatorch/_generated ] || ln -s ../generated xlatorch/_generated
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PJRT_DEVICE=${PJRT_DEVICE:-GPU}
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run one part with a limit, its log kept
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}
if [ "${2:-}" = quick ]; then  # the checks after a change: overlap, a sync's cost, the CUDA-backward error
    step repro 60 "$py" -c "import torch, xlatorch
x = torch.ones(2, device='cuda', requires_grad=True)
try:
    (x * 2).sum().backward(); print('a CUDA backward after import xlatorch: ran')
except RuntimeError as e:
    print('a CUDA backward after import xlatorch:', e)"
    step overlap 100 "$py" -m bench.overlap --size 2048 --ops 300 --steps 20
    step sync_cost 60 "$py" -m bench.sync_cost 10 100
    exit 0
fi
step env 20 bash -c "nvidia-smi -L; nproc; $py -c 'import sys, torch, jax, jaxlib; print(sys.version.split()[0], \"torch\", torch.__version__, \"jax\", jax.__version__, jaxlib.__version__, jax.devices())'"
step bench 220 "$py" -m bench.bench --steps 40 --eager-device "${EAGER_DEVICE:-cuda}" --out "$out/bench.jsonl"
step overlap 100 "$py" -m bench.overlap --size 2048 --ops 300 --steps 20
step agree 150 "$py" -m bench.agree --steps 5
step sync_cost 30 "$py" -m bench.sync_cost 10 100 1000
