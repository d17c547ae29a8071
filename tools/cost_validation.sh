#!/usr/bin/env bash
# Check the planner's cost model against real CPU runs (docs/planner.md, "Validation"):
# a bandwidth profile, then per plan one timed run (communication) and one run under an
# allocator that returns freed memory (peak memory), then the comparison tables.
#
#   bash tools/cost_validation.sh [OUT_DIR] [PLANS...]
#
# 4 ranks as 2 "nodes" of 2 on this machine, gloo over loopback, fp32 debugmodel.
# About 80 s for the profile and 30-50 s per plan and kind of run: 7-13 min for 6 plans,
# more when other jobs load the machine (the timing is only meaningful on a quiet one).
set -euo pipefail
out=${1:-outputs/cost_validation}
shift || true
plans=("$@")
[ ${#plans[@]} -gt 0 ] || plans=(1,1,1 1,1,4 1,2,2 2,2,2 2,2,4 4,4,4)
mkdir -p "$out"
export OMP_NUM_THREADS=1
# run LOG ARGS..: torchrun with 4 ranks, output to LOG; on failure say where to look
run() {
    local log=$1; shift
    torchrun --nproc_per_node 4 --master_port "${MASTER_PORT:-29571}" "$@" > "$log" 2>&1 \
        || { echo "failed: $* (see $log)" >&2; exit 1; }
}

echo "== profile ($(date -u +%H:%M:%S) UTC)"
run "$out/profile.log" -m amsp_dtensor.plan.profile --out "$out/bw.json" --ranks-per-node 2 \
    --dtype float32
comm_runs=() mem_runs=()
for plan in "${plans[@]}"; do
    name=${plan//,/-}
    comm_runs+=("$out/comm_$name.json") mem_runs+=("$out/mem_$name.json")
    echo "== $name: communication, then memory ($(date -u +%H:%M:%S) UTC)"
    # communication: glibc's default allocator (freed memory stays resident, as on GPU)
    run "$out/comm_$name.log" -m amsp_dtensor.plan.validate --plan "$plan" \
        --ranks-per-node 2 --steps 8 --table "$out/bw.json" --out "$out/comm_$name.json"
    # memory: freed tensors go back to the OS, so ru_maxrss follows the live bytes
    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 \
        run "$out/mem_$name.log" -m amsp_dtensor.plan.validate --plan "$plan" \
        --ranks-per-node 2 --steps 3 --out "$out/mem_$name.json"
done
echo
echo "== step communication time (predicted with $out/bw.json)"
python -m amsp_dtensor.plan.validate summarize --comm --table "$out/bw.json" "${comm_runs[@]}"
echo
echo "== peak memory (MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0)"
python -m amsp_dtensor.plan.validate summarize --memory "${mem_runs[@]}"
