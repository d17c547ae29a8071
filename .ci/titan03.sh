#!/usr/bin/env bash
# Check this checkout on torchtitan 0.3, in a venv of its own (torchtitan 0.2.2 and 0.3
# cannot share one; the main venv keeps 0.2.2):
#
#   .ci/titan03.sh [--install-only | --subset | --moe | --cp | --lists [tool flags]]
#
# builds (or reuses) a venv (TITAN03_VENV, default /tmp/venv-titan03-<checksum of this
# checkout's path>[-torch<version>]) that sees the outer Python's packages, with torch
# TITAN03_TORCH (default 2.14.1, what torchtitan 0.3.0 was validated with and the torch
# its own pipeline schedules need: a CUDA build that runs on CPU, its venv about 5 GB
# with the CUDA libraries; --subset defaults to 2.13.0, the main suite's, which it
# reuses from the outer Python), torchtitan 0.3.0 and its dependencies, and this checkout
# editable with the titan03 extra; then runs
#   1. tests/test_titan03.py: AMSP against torchtitan 0.3's own FSDP2 and FSDP2 + TP (20
#      steps, loss within 1e-4 at every step), a 4-rank checkpoint resumed on 2 ranks
#      under another plan, the TensorBoard scalars, plan = "auto", per-block compile, the
#      TOML mapping and the bad-input refusals, and the MoE parity (as --moe);
#   2. the README's main job (recipes/debug_cpu.toml, 4 ranks, 20 steps) on 0.3, printing
#      its loss at steps 1, 10 and 20;
#   3. torchtitan 0.3's own llama3 debug model (its config registry entry, its own
#      launcher module) on 4 CPU ranks, 5 steps, with the CPU shims of
#      amsp_dtensor/titan/v03/cpu_compat.py: the fact that 0.3 itself trains here.
# --subset runs only the part of (1) that the main suite runs through
# tests/test_titan03_venv.py: AMSP (2, 2, 2) x tp 2 against torchtitan 0.3's FSDP2 + TP at 5
# steps, the TOML mapping, the param-group mapping, one refusal, the plan resolved once, a
# seed checkpoint made by an AMSP job.
# --moe runs only the MoE parity of (1): AMSP against torchtitan 0.3's own FSDP2 + EP 2,
# deepseek_v3 debugmodel on 4 CPU ranks from the same weights, 3 (dense plan, expert plan)
# pairs, and beside tp 2 (ep 4 and ep 2) against its FSDP2 + TP + EP, 10 steps, every
# step's loss within 1e-5 (printed per step in $venv/logs/test_titan03_moe.txt; about 10
# minutes); TITAN03_MOE_MODELS=deepseek_v3,qwen3
# adds qwen3 debugmodel_moe with fp32 experts (about 10 minutes a run: the reference, each
# pair, and torchtitan's qwen3_debugmodel_moe_param_groups' groups on both sides: docs/moe.md),
# TITAN03_MOE_PAIRS=<names> picks pairs, TITAN03_MOE_STEPS the steps.
# --cp runs only the context-parallel parity of (1): AMSP against torchtitan 0.3's own
# FSDP2 + CP from the same weights, seq_len 512, 10 steps, every step's loss within 1e-4
# (printed per step in $venv/logs/test_titan03_cp.txt): cp 2 x dp 2 and cp 4 on 4 ranks,
# plan (2, 2, 4) and torchtitan's layout, cp 2 x dp 2 x tp 2 and hsdp 2 x 2 x cp 2 on 8
# ranks; TITAN03_CP_CASES=<ids> picks cases, TITAN03_CP_STEPS the steps; and the refusals.
# --lists runs tools/titan03_lists.py with the flags after it: torchtitan 0.3's own
# integration lists (the 63 configs of torchtitan_recipes/tests/features.py and models.py),
# CPU-sized, through AMSP and, where AMSP does not pass, torchtitan's own trainer; the table
# in outputs/titan03_lists/lists.md (docs/torchtitan.md quotes it; about 2 hours).
# Exit 0 when all pass. Wall time on 2 CPU cores: see docs/torchtitan.md ("torchtitan 0.3").
set -uo pipefail

mode=${1:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
default_torch=2.14.1
[ "$mode" = "--subset" ] && default_torch=2.13.0
torch_version=${TITAN03_TORCH:-$default_torch}
venv=${TITAN03_VENV:-/tmp/venv-titan03-$(printf %s "$repo" | cksum | cut -d' ' -f1)$([ "$torch_version" = 2.13.0 ] || echo "-torch$torch_version")}
py=$venv/bin/python
SUBSET="with_tp_2_matches_torchtitan_03 or maps_onto or map_onto_one_torch_optimizer or (bad_input and divide) or resolved_once or seed_checkpoint_of_an_amsp"

source "$repo/.ci/lib.sh"

if ! venv_install "$venv" "$torch_version" --system-site-packages -e "$repo[titan03]" "pytest>=8"; then
  echo "titan03: install failed" >&2
  exit 1
fi
got=$("$py" -c "import torch, importlib.metadata as m; print(torch.__version__, 'torchtitan', m.version('torchtitan'))")
echo "$got in $venv"
[ "$mode" = "--install-only" ] && exit 0

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$venv/logs
rm -rf "$log" && mkdir -p "$log"
status=0
cd "$repo"

if [ "$mode" = "--subset" ]; then
  TITAN03_STEPS=5 pytest_tally "$py" "$log/test_titan03.txt" "test_titan03 (subset)" \
    tests/test_titan03.py -k "$SUBSET" || status=1
  echo "logs in $log"
  exit "$status"
fi

if [ "$mode" = "--cp" ]; then
  TITAN03_CP_CASES=${TITAN03_CP_CASES:-all} \
    pytest_tally "$py" "$log/test_titan03_cp.txt" "test_titan03 (context-parallel parity)" -s \
    tests/test_titan03.py -k "context_parallel" || status=1
  grep -E "^cp[0-9_a-z-]+: |^hsdp[0-9_a-z-]+: |^ +[0-9]+  " "$log/test_titan03_cp.txt"
  echo "logs in $log"
  exit "$status"
fi

if [ "$mode" = "--lists" ]; then
  shift
  OMP_NUM_THREADS=1 "$py" tools/titan03_lists.py "$@"
  exit $?
fi

if [ "$mode" = "--moe" ]; then
  pytest_tally "$py" "$log/test_titan03_moe.txt" "test_titan03 (MoE parity)" -s \
    tests/test_titan03.py -k "moe_loss_matches or moe_param_groups or beside_tp" || status=1
  grep -E "^(deepseek_v3|qwen3) |^ +[0-9]+  " "$log/test_titan03_moe.txt"
  echo "logs in $log"
  exit "$status"
fi

pytest_tally "$py" "$log/test_titan03.txt" test_titan03 tests/test_titan03.py || status=1
main_job "$venv" "$repo" "$log/main_job.txt" "main job on torchtitan 0.3" || status=1

# torchtitan 0.3's own trainer and llama3 debug model, its data paths pointed at the
# main job's offline data; only the CPU shims are ours.
own=$venv/own_job
rm -rf "$own" && mkdir -p "$own"
cat > "$own/run.py" <<'PY'
from amsp_dtensor.titan.v03 import cpu_compat

cpu_compat.apply()
from torchtitan.train import main

main()
PY
start=$SECONDS
(cd "$own" && PYTHONPATH="$repo" "$py" -m torch.distributed.run --standalone --nproc_per_node 4 run.py \
  --module llama3 --config llama3_debugmodel_ce_loss \
  --hf_assets_path "$venv/main_job/outputs/amsp_data/tokenizer" \
  --dataloader.dataset_path "$venv/main_job/outputs/amsp_data/corpus" \
  --training.seq_len 256 --training.local_batch_size 2 --training.steps 5 \
  --training.disable_cuda_graphs --parallelism.spmd_backend partial_dtensor \
  --checkpoint.no-enable --dump_folder "$own/outputs") > "$log/own_job.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
echo "torchtitan 0.3's own llama3_debugmodel_ce_loss: exit $rc [$((SECONDS - start)) s]; losses $(losses_of "$log/own_job.txt" "1 5")"
echo "logs in $log"
exit "$status"
