"""torchtitan's integration feature list, run through AMSP on CPU ranks.

    python tools/titan_features.py --torchtitan-src DIR [--only NAME,...] [--steps 10]
                                   [--out DIR] [--no-reference] [--timeout 900]

DIR is a checkout of torchtitan at the installed release (v0.2.2): its
``tests/integration_tests/features.py`` gives the tests (read from there, never copied), and
its ``scripts/generate`` the generation step of ``test_generate``. Each test runs as
torchtitan's ``run_tests.py`` runs it (its override lists in order, one dump folder per
test, so a later list resumes from an earlier one's checkpoint), with
``python -m amsp_dtensor.train`` on the debug recipe instead of ``./run_train.sh``, on
``ngpu`` gloo ranks (one simulated node), ``--training.steps`` (default 10) before the
test's own overrides, and the [amsp] factors left to torchtitan's data-parallel flags
(``--amsp.param_shard dp`` and the others), so the flags a test passes decide the layout.

Each test gets PASS (every run exits 0), REFUSED (a run exits 2 with one line,
``amsp_dtensor.train: error: ...``) or CRASH (anything else); a test that does not pass
is run again with torchtitan's own trainer (``--model.name llama3``, unless
``--no-reference``). The plan AMSP applied (its start-up line) is listed beside a pass.
Prints a markdown table (also written to OUT/features.md, and OUT/features.json);
exit 0 when every test torchtitan's own trainer passes also passes through AMSP.
Runs one test at a time; 8-rank tests take minutes on 2 cores. The float8 and HF-checkpoint
tests need the extras: ``pip install -e '.[float8,hf]'`` (torchao, safetensors).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug_cpu.toml"
ERROR_PREFIX = "amsp_dtensor.train: error: "
# a checkpoint path features.py names relative to torchtitan's output folder
OUTPUT_DIR = "artifacts-to-be-uploaded"
# What a test takes from torchtitan's debug config (its base) that the debug recipe sets
# otherwise: pp_custom_csv's schedule file lists 8 micro-batches, one per sequence of
# that config's local batch of 8 (the recipe's 2 give 2 micro-batches, which torch's
# schedule refuses: "Got 8 FORWARD microbatches for stage 0, expected 2").
GENERATE_WITH_SHIMS = (
    "import runpy, sys; from amsp_dtensor.titan import cpu_compat; cpu_compat.apply(); "
    "import amsp_dtensor.titan; module = sys.argv.pop(1); "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)")
BASE_CONFIG = {"pp_custom_csv": ["--training.local_batch_size", "8",
                                 "--training.global_batch_size", "-1"]}


def load_feature_list(src: Path) -> list:
    """``build_features_test_list()`` of ``src``'s features.py, with its
    ``OverrideDefinitions`` from ``src`` too (imported under a private package name, so
    this repository's own ``tests`` folder does not shadow it)."""
    package = src / "tests" / "integration_tests"
    if not (package / "features.py").is_file():
        raise SystemExit(f"--torchtitan-src {src}: no tests/integration_tests/features.py "
                         "there; pass a checkout of torchtitan (git clone "
                         "https://github.com/pytorch/torchtitan -b v0.2.2)")
    defs = types.ModuleType("tests.integration_tests")
    saved = {k: sys.modules.get(k) for k in ("tests", "tests.integration_tests")}
    sys.modules["tests"] = types.ModuleType("tests")
    sys.modules["tests.integration_tests"] = defs
    try:
        exec(compile((package / "__init__.py").read_text(), str(package / "__init__.py"),
                     "exec"), defs.__dict__)
        features: dict = {}
        exec(compile((package / "features.py").read_text(), str(package / "features.py"),
                     "exec"), features)
        return features["build_features_test_list"]()
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module


@dataclasses.dataclass
class Run:
    result: str  # PASS, REFUSED, CRASH
    detail: str = ""  # the refusal line, the crash's last error line, or the plan applied
    seconds: float = 0.0
    loss: str = ""  # the last step's loss, where the caller reads it
    ranks: int | None = None  # the ranks it ran on, where the caller says


def classify(proc: subprocess.CompletedProcess, amsp: bool) -> Run:
    err = proc.stderr.strip().splitlines()
    if proc.returncode == 0:
        log = proc.stdout + proc.stderr
        plan = re.search(r"Applied AMSP plan (\S+)", log)
        return Run("PASS", plan.group(1) if (amsp and plan) else "")
    # torchrun exits 1 when a rank fails; the rank's own exit code is in its report
    refusals = sorted({line for line in err if line.startswith(ERROR_PREFIX)})
    rank_codes = set(re.findall(r"exitcode\s*: (-?\d+)", proc.stderr))
    # one traceback: torchrun's own ChildFailedError; a rank's would add another
    if amsp and len(refusals) == 1 and rank_codes <= {"2", "-15"} and (
            proc.stderr.count("Traceback (most recent call last)") <= 1):
        return Run("REFUSED", refusals[0][len(ERROR_PREFIX):])
    if proc.returncode == 124:
        return Run("CRASH", "timed out")
    errors = [line.strip() for line in err
              if re.search(r"(Error|Exception|error:|Fatal|Segmentation|exc\.Unsupported)", line)
              and "ChildFailedError" not in line and "elastic" not in line]
    return Run("CRASH", (errors[-1] if errors else f"exit {proc.returncode}")[:300])


def run_test(test, src: Path, work: Path, steps: int, timeout: int, amsp: bool) -> Run:
    """One OverrideDefinitions through AMSP (amsp=True) or torchtitan's own trainer."""
    dump = work / OUTPUT_DIR / test.test_name / ("amsp" if amsp else "torchtitan")
    # features.py's HF checkpoint path is OUTPUT_DIR/<test>/hf_checkpoint/step-10
    link = work / OUTPUT_DIR / test.test_name / "hf_checkpoint"
    data = REPO / "outputs" / "amsp_data"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(src)]))
    # a compile cache of this test's own: the machine-wide one (/tmp/torchinductor_<user>)
    # served 3d_compile a compiled loss from another job whose functional collectives name
    # a process group this job never made ("Could not resolve the process group registered
    # under the name 82"); with a fresh cache it passes
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(dump.parent / "inductor_cache"))
    dump.parent.mkdir(parents=True, exist_ok=True)
    total = 0.0
    last = Run("PASS")
    for index, overrides in enumerate(test.override_args):
        args = [a for item in overrides for a in shlex.split(item)]
        base = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(test.ngpu)]
        if test.test_name == "test_generate" and index == 1:
            # torchtitan's generation script on the checkpoint the first run saved, with
            # the CPU shims applied and the AMSP train specs registered first (the script
            # imports torchtitan itself: without the shims, "No module named 'triton'")
            cmd = [*base, "--no-python", sys.executable, "-c", GENERATE_WITH_SHIMS,
                   "scripts.generate.test_generate", f"--config={RECIPE}",
                   f"--checkpoint={dump / 'checkpoint' / f'step-{steps}'}",
                   "--prompt=What is the meaning of life?", "--out"]
            cwd = work  # the recipe's relative data paths resolve there (main's links)
        else:
            cmd = [*base, "-m", "amsp_dtensor.train", "--job.config_file", str(RECIPE),
                   "--job.dump_folder", str(dump), "--training.steps", str(steps),
                   "--model.hf_assets_path", str(data / "tokenizer"),
                   "--training.dataset_path", str(data / "corpus")]
            if amsp:
                cmd += ["--amsp.param_shard", "dp", "--amsp.grad_shard", "dp",
                        "--amsp.optim_shard", "dp", "--amsp.ranks_per_node", "0"]
            else:
                cmd += ["--model.name", "llama3"]
            cmd += BASE_CONFIG.get(test.test_name, []) + args
            cwd = work
        start = time.monotonic()
        proc = subprocess.run(["timeout", str(timeout), *cmd], cwd=cwd, env=env,
                              capture_output=True, text=True)
        seconds = time.monotonic() - start
        total += seconds
        (dump.parent / f"{dump.name}-{index}.log").write_text(
            " ".join(shlex.quote(c) for c in cmd) + "\n" + proc.stdout + proc.stderr)
        last = classify(proc, amsp and not (test.test_name == "test_generate" and index == 1))
        if index == 0 and (dump / "hf_checkpoint").is_dir() and not link.exists():
            link.symlink_to(dump / "hf_checkpoint")
        if last.result != "PASS":
            break
    last.seconds = total
    return last


@contextlib.contextmanager
def _locked(path: Path | None):
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan-src", type=Path,
                        default=os.environ.get("TORCHTITAN_SRC"), required=
                        "TORCHTITAN_SRC" not in os.environ,
                        help="a torchtitan checkout at the installed release")
    parser.add_argument("--only", default="", help="comma-separated test names")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "titan_features")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a lock file held (flock) while each test runs, so other "
                        "jobs on a small machine take turns with this one")
    parser.add_argument("--no-reference", action="store_true",
                        help="do not run torchtitan's own trainer where AMSP does not pass")
    args = parser.parse_args(argv)
    src = args.torchtitan_src.resolve()
    tests = [t for t in load_feature_list(src) if not t.disabled]
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {t.test_name for t in tests})
        if unknown:
            raise SystemExit(f"--only: no test named {', '.join(unknown)} in the list")
        tests = [t for t in tests if t.test_name in names]
    from amsp_dtensor.data import ensure_assets

    ensure_assets(REPO / "outputs" / "amsp_data")
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "tests").unlink(missing_ok=True)  # features.py's relative asset paths
    (work / "tests").symlink_to(src / "tests")
    (work / "outputs").unlink(missing_ok=True)  # the recipe's ./outputs/amsp_data
    (work / "outputs").symlink_to(REPO / "outputs")
    rows = []
    for test in tests:
        with _locked(args.lock):
            amsp = run_test(test, src, work, args.steps, args.timeout, amsp=True)
            titan = None
            if amsp.result != "PASS" and not args.no_reference:
                titan = run_test(test, src, work, args.steps, args.timeout, amsp=False)
        row = {"test": test.test_name, "ranks": test.ngpu, "amsp": amsp.result,
               "detail": amsp.detail, "seconds": round(amsp.seconds),
               "torchtitan": None if titan is None else titan.result,
               "torchtitan_detail": None if titan is None else titan.detail}
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = ["test", "ranks", "AMSP", "plan / reason", "s",
               "torchtitan's own (where AMSP does not pass)"]
    return report(rows, "test", columns, lambda r: [
        r["test"], r["ranks"], r["amsp"], r["detail"], r["seconds"], own_result(r)],
        work / "features")


def own_result(row: dict) -> str:
    """torchtitan's own result of a row, with its reason; "" where it did not run."""
    if row["torchtitan"] is None:
        return ""
    return row["torchtitan"] + (f": {row['torchtitan_detail']}"
                                if row["torchtitan_detail"] else "")


def report(rows: list[dict], key: str, columns: list[str], cells, stem: Path) -> int:
    """Print the rows as a markdown table (also ``stem``.md, and ``stem``.json) and the
    tally; exit code 1 where torchtitan's own trainer passes and AMSP does not."""
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(c).replace("|", "/") for c in cells(r)) + " |"
              for r in rows]
    text = "\n".join(table)
    print(text)
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    gaps = [r[key] for r in rows if r["amsp"] != "PASS" and r["torchtitan"] == "PASS"]
    tally = {k: sum(r["amsp"] == k for r in rows) for k in ("PASS", "REFUSED", "CRASH")}
    print(f"{len(rows)} {key}s: {tally['PASS']} pass, {tally['REFUSED']} refused in one line, "
          f"{tally['CRASH']} crash; torchtitan passes where AMSP does not: "
          f"{', '.join(gaps) or 'none'}")
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main())
