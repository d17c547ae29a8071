#!/usr/bin/env bash
# Check this checkout on torchtitan 0.3, in a venv of its own (torchtitan 0.2.2 and 0.3
# cannot share one; the main venv and .ci/run keep 0.2.2):
#
#   .ci/titan03.sh [--install-only]
#
# builds (or reuses) /tmp/venv-titan03 (TITAN03_VENV sets it) with torch 2.13.0 (the CPU
# wheel), torchtitan 0.3.0 and this checkout editable with the titan03 extra, then runs
#   1. tests/test_titan03.py: AMSP against torchtitan 0.3's own FSDP2 and FSDP2 + TP (20
#      steps, loss within 1e-4 at every step), a 4-rank checkpoint resumed on 2 ranks
#      under another plan, the TensorBoard scalars, plan = "auto", per-block compile, the
#      TOML mapping and the bad-input refusals;
#   2. the README's main job (recipes/debug_cpu.toml, 4 ranks, 20 steps) on 0.3, printing
#      its loss at steps 1, 10 and 20;
#   3. torchtitan 0.3's own llama3 debug model (its config registry entry, its own
#      launcher module) on 4 CPU ranks, 5 steps, with the CPU shims of
#      amsp_dtensor/titan/v03/cpu_compat.py: the fact that 0.3 itself trains here.
# Exit 0 when all pass. Wall time on 2 CPU cores: see docs/torchtitan.md ("torchtitan 0.3").
set -uo pipefail

install_only=${1:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${TITAN03_VENV:-/tmp/venv-titan03}
py=$venv/bin/python

# A constraint file pinning torch (it replaces any the pip configuration sets) while the
# checkout's requirements are resolved.
install() {
  [ -x "$py" ] || python3 -m venv "$venv" || return 1
  echo "torch==2.13.0" > "$venv/torch-constraint.txt"
  export PIP_CONSTRAINT=$venv/torch-constraint.txt
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "$py" -m pip install -q "torch==2.13.0" || return 1
  fi
  "$py" -m pip install -q -e "$repo[titan03]" "pytest>=8" || return 1
  unset PIP_CONSTRAINT
}

if ! install; then
  echo "titan03: install failed" >&2
  exit 1
fi
got=$("$py" -c "import torch, importlib.metadata as m; print(torch.__version__, 'torchtitan', m.version('torchtitan'))")
echo "$got in $venv"
[ "$install_only" = "--install-only" ] && exit 0

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$venv/logs
rm -rf "$log" && mkdir -p "$log"
status=0
cd "$repo"

start=$SECONDS
"$py" -m pytest -q -p no:cacheprovider tests/test_titan03.py > "$log/test_titan03.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
tally=$(grep -E "(passed|failed|error|skipped).* in [0-9.]+s" "$log/test_titan03.txt" | tail -1 | tr -d "=" | xargs)
echo "test_titan03: ${tally:-no tally (exit $rc)} [$((SECONDS - start)) s]"
grep -E '^(FAILED|ERROR) ' "$log/test_titan03.txt" | head -20 | sed 's/^/    /'

losses_of() {  # "step N loss X" for steps 1, 10 and 20 of a torchtitan log
  sed 's/\x1b\[[0-9;]*m//g' "$1" | grep -E '^\[titan\]' | grep -oE 'step: *[0-9]+ +loss: *[0-9.]+' | sort -u \
    | awk '{ if ($2 == 1 || $2 == 5 || $2 == 10 || $2 == 20) printf "step %s %s  ", $2, $4 }'
}

# The README's main job, in a scratch folder (its outputs/ are made there on first run).
job=$venv/main_job
rm -rf "$job" && mkdir -p "$job"
start=$SECONDS
(cd "$job" && "$venv/bin/torchrun" --nproc_per_node 4 -m amsp_dtensor.train \
  --job.config_file "$repo/recipes/debug_cpu.toml") > "$log/main_job.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
echo "main job on torchtitan 0.3: exit $rc [$((SECONDS - start)) s]; losses $(losses_of "$log/main_job.txt")"

# torchtitan 0.3's own trainer and llama3 debug model, its data paths pointed at the
# main job's offline data; only the CPU shims are ours.
own=$venv/own_job
rm -rf "$own" && mkdir -p "$own"
cat > "$own/run.py" <<'EOF'
from amsp_dtensor.titan.v03 import cpu_compat

cpu_compat.apply()
from torchtitan.train import main

main()
EOF
start=$SECONDS
(cd "$own" && PYTHONPATH="$repo" "$venv/bin/torchrun" --standalone --nproc_per_node 4 run.py \
  --module llama3 --config llama3_debugmodel_ce_loss \
  --hf_assets_path "$job/outputs/amsp_data/tokenizer" \
  --dataloader.dataset_path "$job/outputs/amsp_data/corpus" \
  --training.seq_len 256 --training.local_batch_size 2 --training.steps 5 \
  --training.disable_cuda_graphs --parallelism.spmd_backend partial_dtensor \
  --checkpoint.no-enable --dump_folder "$own/outputs") > "$log/own_job.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
echo "torchtitan 0.3's own llama3_debugmodel_ce_loss: exit $rc [$((SECONDS - start)) s]; losses $(losses_of "$log/own_job.txt")"
echo "logs in $log"
exit "$status"
