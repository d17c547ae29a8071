#!/usr/bin/env bash
# Check this checkout against another torch release, in a venv of its own:
#
#   .ci/torch_versions.sh VERSION [--install-only]
#
# builds (or reuses) /tmp/torchcheck-VERSION with torch==VERSION and this checkout editable
# (test and bench extras, torch held at VERSION), runs tests/test_compat.py, test_engine.py,
# test_titan.py, test_checkpoint.py and test_tensor_parallel.py one module at a time,
# tools/gpu_check.py (its CPU part, plans 2,2,8 and 1,1,16) and the README's main job, and
# prints each module's tally, gpu_check's verdicts and the job's loss at steps 1, 10 and 20.
# Exit 0 when all pass. TORCH_CHECK_MODULES="test_titan test_compat" runs those modules
# instead of the five (then also gpu_check and the main job).
# Results in docs/torch_versions.md (.ci/run checks torch 2.13.0; this checks the other
# releases, by hand). Releases other than the README's come as CUDA wheels (a few GB) from
# PyPI, which run on CPU.
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 VERSION [--install-only]" >&2
  exit 2
fi
version=$1
install_only=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${TORCH_CHECK_VENV:-/tmp/torchcheck-$version}
py=$venv/bin/python

# A constraint file pinning torch: replaces any constraint the pip configuration sets (one
# capping torch below VERSION would make the install fail), and keeps torch at VERSION
# while the package's own requirements are resolved.
install() {
  [ -x "$py" ] || python3 -m venv "$venv" || return 1
  echo "torch==$version" > "$venv/torch-constraint.txt"
  export PIP_CONSTRAINT=$venv/torch-constraint.txt
  if ! "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    "$py" -m pip install -q "torch==$version" || return 1
  fi
  "$py" -m pip install -q -e "$repo[test,bench]" || return 1
  unset PIP_CONSTRAINT
}

if ! install; then
  echo "torch $version: install failed" >&2
  exit 1
fi
got=$("$py" -c "import torch; print(torch.__version__)")
echo "torch $got in $venv (python $("$py" -c 'import platform; print(platform.python_version())'))"
[ "$install_only" = "--install-only" ] && exit 0

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$venv/logs
rm -rf "$log" && mkdir -p "$log"
status=0
cd "$repo"
modules=${TORCH_CHECK_MODULES:-test_compat test_engine test_titan test_checkpoint test_tensor_parallel}
for module in $modules; do
  start=$SECONDS
  "$py" -m pytest -q -p no:cacheprovider "tests/$module.py" > "$log/$module.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  # pytest's closing line, e.g. "2 failed, 24 passed in 8.1s" (-q prints no ===)
  tally=$(grep -E "(passed|failed|error|skipped).* in [0-9.]+s" "$log/$module.txt" | tail -1 | tr -d "=" | xargs)
  echo "$module: ${tally:-no tally (exit $rc)} [$((SECONDS - start)) s]"
  grep -E '^(FAILED|ERROR) ' "$log/$module.txt" | head -20 | sed 's/^/    /'
done

for plan in 2,2,8 1,1,16; do
  "$py" tools/gpu_check.py --device cpu --plan "$plan" > "$log/gpu_check_$plan.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "gpu_check --plan $plan: exit $rc; $(grep '^gpu_check:' "$log/gpu_check_$plan.txt" | head -3 | tr '\n' ' ')"
done

# The README's main job, in a scratch folder: its outputs/ (data, tokenizer, dump folder)
# are made there on first run, as in a fresh checkout.
job=$venv/main_job
rm -rf "$job" && mkdir -p "$job"
start=$SECONDS
(cd "$job" && "$venv/bin/torchrun" --nproc_per_node 4 -m amsp_dtensor.train \
  --job.config_file "$repo/recipes/debug_cpu.toml") > "$log/main_job.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] || status=1
# torchtitan colours its log lines: strip the escape codes, then keep "step: N ... loss: X"
losses=$(sed 's/\x1b\[[0-9;]*m//g' "$log/main_job.txt" \
  | grep -oE 'step: *[0-9]+ +loss: *[0-9.]+' \
  | awk '{ if ($2 == 1 || $2 == 10 || $2 == 20) printf "step %s %s  ", $2, $4 }')
echo "main job: exit $rc [$((SECONDS - start)) s]; losses ${losses:-not found}"
echo "logs in $log"
exit "$status"
