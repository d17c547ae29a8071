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

source "$repo/.ci/lib.sh"

if ! venv_install "$venv" "$version" -e "$repo[test,bench]"; then
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
  pytest_tally "$py" "$log/$module.txt" "$module" "tests/$module.py" || status=1
done

for plan in 2,2,8 1,1,16; do
  "$py" tools/gpu_check.py --device cpu --plan "$plan" > "$log/gpu_check_$plan.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "gpu_check --plan $plan: exit $rc; $(grep '^gpu_check:' "$log/gpu_check_$plan.txt" | head -3 | tr '\n' ' ')"
done

main_job "$venv" "$repo" "$log/main_job.txt" "main job" || status=1
echo "logs in $log"
exit "$status"
