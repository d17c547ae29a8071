#!/usr/bin/env bash
# Check the planner's cost model against real CPU runs (issue 3, must-show 2 and 3):
# a bandwidth profile, then per plan one timed run (communication) and one run under an
# allocator that returns freed memory (peak memory), then the comparison tables.
#
#   bash tools/cost_validation.sh [OUT_DIR] [PLANS...]
#
# 4 ranks as 2 "nodes" of 2 on this machine, gloo over loopback, fp32 debugmodel.
# About 80 s for the profile and 40-60 s per plan and kind of run (2 cores).
set -euo pipefail
out=${1:-outputs/cost_validation}
shift || true
plans=("$@")
[ ${#plans[@]} -gt 0 ] || plans=(1,1,1 1,1,4 1,2,2 2,2,2 2,2,4 4,4,4)
mkdir -p "$out"
export OMP_NUM_THREADS=1
run() { torchrun --nproc_per_node 4 --master_port "${MASTER_PORT:-29571}" "$@"; }

echo "== profile ($(date -u +%H:%M:%S) UTC)"
run -m amsp_dtensor.profile --out "$out/bw.json" --ranks-per-node 2 --dtype float32 \
    > "$out/profile.log" 2>&1
for plan in "${plans[@]}"; do
    name=${plan//,/-}
    echo "== $name: communication, then memory ($(date -u +%H:%M:%S) UTC)"
    # communication: glibc's default allocator (freed memory stays resident, as on GPU)
    run -m amsp_dtensor.cost.validate --plan "$plan" --ranks-per-node 2 --steps 8 \
        --table "$out/bw.json" --out "$out/comm_$name.json" > "$out/comm_$name.log" 2>&1
    # memory: freed tensors go back to the OS, so ru_maxrss follows the live bytes
    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 \
        run -m amsp_dtensor.cost.validate --plan "$plan" --ranks-per-node 2 --steps 3 \
        --out "$out/mem_$name.json" > "$out/mem_$name.log" 2>&1
done
echo
echo "== step communication time (predicted with $out/bw.json)"
python -m amsp_dtensor.cost.validate summarize --comm --table "$out/bw.json" "$out"/comm_*.json
echo
echo "== peak memory (MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0)"
python -m amsp_dtensor.cost.validate summarize --memory "$out"/mem_*.json
