#!/usr/bin/env bash
# The tensor-parallel recipe N times in a row beside a CPU burner, to catch crashes that
# only a loaded machine shows (a gloo wait under TP's functional collectives once died
# with a segmentation fault at such a load):
#
#   tools/stress_tp.sh [N=20] [STEPS=20] [BURNERS=2]
#
# Each run: the debug recipe on 4 CPU ranks, tensor_parallel_degree 2, plan p2-g2-os2,
# STEPS steps, PYTHONFAULTHANDLER=1 (a fatal signal prints every thread's Python stack).
# BURNERS busy-loop processes run for the whole loop. Prints one line per run (exit code,
# seconds, final loss, any "Fatal Python error" line) and the tally; logs in
# outputs/stress_tp/. Exit 0 when all N runs exit 0.
set -uo pipefail
n=${1:-20}
steps=${2:-20}
burners=${3:-2}
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$repo/outputs/stress_tp
mkdir -p "$out"
cd "$repo"

pids=()
for _ in $(seq "$burners"); do
  python3 -c "while True: pass" &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT

ok=0
crashes=0
for i in $(seq "$n"); do
  log=$out/run-$i.log
  start=$SECONDS
  PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 timeout 1200 \
    python -m torch.distributed.run --standalone --nproc_per_node 4 -m amsp_dtensor.train \
      --job.config_file recipes/debug_cpu.toml --job.dump_folder "$out/dump-$i" \
      --training.steps "$steps" --parallelism.tensor_parallel_degree 2 \
      --amsp.param_shard 2 --amsp.grad_shard 2 --amsp.optim_shard 2 > "$log" 2>&1
  rc=$?
  loss=$(grep -a -o "step: *$steps .*loss: *[0-9.]*" "$log" | grep -o "[0-9.]*$" | tail -1)
  fatal=$(grep -a -m1 "Fatal Python error" "$log")
  if [ "$rc" -eq 0 ]; then ok=$((ok + 1)); else crashes=$((crashes + 1)); fi
  echo "run $i: exit $rc, $((SECONDS - start)) s, loss at step $steps ${loss:-none}${fatal:+, $fatal}"
done
echo "tensor-parallel recipe x $n beside $burners CPU burners: $ok passed, $crashes failed"
[ "$crashes" -eq 0 ]
