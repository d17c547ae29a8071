#!/usr/bin/env bash
# torchtitan 0.2.2's own MoE training (its FSDP2 + expert parallelism, no AMSP) on 4 CPU
# ranks (gloo, fp32 recipe): the reference AMSP MoE runs are compared against. The CPU
# shims it needs are titan/cpu_compat.py's (1) (token permutation without triton) and
# (10) (histc on int64 expert ids).
#
#   bash tools/titan_moe_cpu.sh [OUT_DIR] [RUN...]     RUN: qwen3_ep2 qwen3_ep1 dsv3_ep2 dsv3_ep1
#
# Every run starts from one seeded full-model initialisation (--amsp.init_like_single_process),
# so EP 2 and EP 1 start from the same weights; the script ends by printing each run's
# losses (TensorBoard loss_metrics/global_avg_loss) and EP 2 against EP 1 per step.
# Measured on 2 cores, OMP_NUM_THREADS=1 (training only, ~15 s of start-up on top):
# qwen3 debugmodel_moe (64 experts, 316M params) ~30-40 s a step, ~4.5 min for 6 steps;
# deepseek_v3 debugmodel (8 experts) ~7 s a step, ~80 s for 10 steps.
# Runs take /tmp/amsp_cpu.lock (LOCK= to run without it); QWEN_STEPS, DSV3_STEPS set steps.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root (OUT_DIR is relative to it)
out=${1:-outputs/titan_moe_cpu}
shift || true
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(qwen3_ep2 qwen3_ep1 dsv3_ep2 dsv3_ep1)
mkdir -p "$out"
export OMP_NUM_THREADS=1
LOCK=${LOCK-flock /tmp/amsp_cpu.lock}
T="python -m torch.distributed.run --standalone --nproc_per_node 4 -m amsp_dtensor.train --job.config_file recipes/debug_cpu.toml --amsp.init_like_single_process"
q=${QWEN_STEPS:-6} d=${DSV3_STEPS:-10}

for run in "${runs[@]}"; do
    rm -rf "${out:?}/$run"
    echo "== $run ($(date -u +%H:%M:%S) UTC), log $out/$run.log"
    case $run in
    qwen3_ep2) $LOCK $T --job.dump_folder "$out/$run" --model.name qwen3 --model.flavor debugmodel_moe --parallelism.expert_parallel_degree 2 --training.steps "$q" ;;
    qwen3_ep1) $LOCK $T --job.dump_folder "$out/$run" --model.name qwen3 --model.flavor debugmodel_moe --parallelism.expert_parallel_degree 1 --training.steps "$q" ;;
    dsv3_ep2)  $LOCK $T --job.dump_folder "$out/$run" --model.name deepseek_v3 --model.flavor debugmodel --parallelism.expert_parallel_degree 2 --training.steps "$d" ;;
    dsv3_ep1)  $LOCK $T --job.dump_folder "$out/$run" --model.name deepseek_v3 --model.flavor debugmodel --parallelism.expert_parallel_degree 1 --training.steps "$d" ;;
    *) echo "unknown run $run (qwen3_ep2 qwen3_ep1 dsv3_ep2 dsv3_ep1)" >&2; exit 2 ;;
    esac > "$out/$run.log" 2>&1 || { echo "failed: $run (see $out/$run.log)" >&2; exit 1; }
done

python - "$out" "${runs[@]}" <<'EOF'
import glob, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out, runs = sys.argv[1], sys.argv[2:]

def losses(run):
    curve = {}
    for folder in glob.glob(f"{out}/{run}/tb/*"):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        curve.update({e.step: e.value for e in acc.Scalars("loss_metrics/global_avg_loss")})
    return [curve[s] for s in sorted(curve)]

curves = {run: losses(run) for run in runs}
for run, curve in curves.items():
    print(f"{run:10s}", " ".join(f"{v:.6f}" for v in curve))
for model in ("qwen3", "dsv3"):
    a, b = curves.get(f"{model}_ep2"), curves.get(f"{model}_ep1")
    if a and b:
        rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
        print(f"{model} EP2 vs EP1, relative per step:", " ".join(f"{r:.1e}" for r in rel))
EOF
