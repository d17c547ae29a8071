# Shell functions shared by .ci/torch_versions.sh and .ci/titan03.sh (sourced, not run):
# a venv with torch held at one version, a pytest module run reduced to its tally line, and
# the README's main job run in a scratch folder with its losses.

# venv_install VENV TORCH_VERSION [--system-site-packages] PIP_ARGS...
# Builds (or reuses) VENV with torch==TORCH_VERSION, then pip-installs PIP_ARGS there. A
# constraint file pins torch (it replaces any the pip configuration sets: one capping torch
# below the version would make the install fail) while PIP_ARGS' requirements resolve.
# --system-site-packages: the venv sees the packages of the Python that builds it (PYTHON,
# default python3), so a torch of the same version there is used, not downloaded again;
# what PIP_ARGS installs into the venv shadows the outer copy.
venv_install() {
  local venv=$1 version=$2
  shift 2
  local site=()
  if [ "${1:-}" = "--system-site-packages" ]; then
    site=(--system-site-packages)
    shift
  fi
  local py=$venv/bin/python
  [ -x "$py" ] || "${PYTHON:-python3}" -m venv "${site[@]}" "$venv" || return 1
  echo "torch==$version" > "$venv/torch-constraint.txt"
  if ! "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    PIP_CONSTRAINT=$venv/torch-constraint.txt "$py" -m pip install -q "torch==$version" || return 1
  fi
  PIP_CONSTRAINT=$venv/torch-constraint.txt "$py" -m pip install -q "$@" || return 1
}

# pytest_tally PY LOG NAME PYTEST_ARGS...: runs pytest, its output to LOG; prints
# "NAME: <pytest's closing line> [seconds]" and the FAILED/ERROR lines; returns its exit code.
pytest_tally() {
  local py=$1 log=$2 name=$3
  shift 3
  local start=$SECONDS rc tally
  "$py" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  # pytest's closing line, e.g. "2 failed, 24 passed in 8.1s" (-q prints no ===)
  tally=$(grep -E "(passed|failed|error|skipped|deselected).* in [0-9.]+s" "$log" | tail -1 | tr -d "=" | xargs)
  echo "$name: ${tally:-no tally (exit $rc)} [$((SECONDS - start)) s]"
  grep -E '^(FAILED|ERROR) ' "$log" | head -20 | sed 's/^/    /'
  return "$rc"
}

# losses_of LOG [STEPS]: "step N X" for steps STEPS (default "1 10 20") of a torchtitan log,
# once per step when every rank logs (torchtitan colours its lines: the escape codes are
# stripped first).
losses_of() {
  sed 's/\x1b\[[0-9;]*m//g' "$1" | grep -oE 'step: *[0-9]+ +loss: *[0-9.]+' | sort -u -k2,2n \
    | awk -v steps=" ${2:-1 10 20} " 'index(steps, " " $2 " ") { printf "step %s %s  ", $2, $4 }'
}

# main_job VENV REPO LOG LABEL: the README's main job (recipes/debug_cpu.toml, 4 ranks) with
# VENV's torchrun, in a scratch folder VENV/main_job (its outputs/ are made there on first
# run, as in a fresh checkout); prints "LABEL: exit N [s]; losses ..."; returns the exit code.
main_job() {
  local venv=$1 repo=$2 log=$3 label=$4
  local job=$venv/main_job start=$SECONDS rc
  rm -rf "$job" && mkdir -p "$job"
  (cd "$job" && "$venv/bin/python" -m torch.distributed.run --nproc_per_node 4 -m amsp_dtensor.train \
    --job.config_file "$repo/recipes/debug_cpu.toml") > "$log" 2>&1
  rc=$?
  local losses
  losses=$(losses_of "$log")
  echo "$label: exit $rc [$((SECONDS - start)) s]; losses ${losses:-not found}"
  return "$rc"
}
