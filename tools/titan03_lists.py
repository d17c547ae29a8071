"""torchtitan 0.3's own integration lists, run through AMSP on CPU ranks.

    <0.3 venv>/bin/python tools/titan03_lists.py [--lists features,models] [--only NAME,...]
        [--reference failing|all|none] [--out DIR] [--timeout 600] [--lock FILE]

(the venv: ``.ci/titan03.sh --install-only``; or ``.ci/titan03.sh --lists``.)
The lists are the config functions torchtitan 0.3 ships with its wheel,
``torchtitan_recipes/tests/features.py`` and ``models.py`` (read from the installed wheel,
never copied): every public function of them, disabled upstream or not. Each config is made
CPU-sized the same way for both trainers (``cpu_sized``): 4/10 of its steps (4 for the
usual 10), seq_len 256 (cp x 128 where context parallelism needs more), local batch 2 (8
under pipeline parallelism, its micro-batches), the global batch scaled with it (so
gradient accumulation stays), fp32, the SPMD backend ``partial_dtensor`` (0.3's default
``spmd_types`` stops on CPU under torch 2.13: docs/torchtitan.md), this project's offline
tokenizer and corpus (a question/answer file made from it for the SFT loader), validation
and profiling at frequencies the shorter run reaches. Each runs on the number of ranks
torchtitan's runner gives it (``ranks``) as one simulated node, a ``*_load*`` config in the
dump folder of its ``*_save``.

AMSP runs first: ``python -m amsp_dtensor.train --module titan03_lists --config
amsp__<list>__<name>`` (``amsp_config`` of the CPU-sized config: AMSP's parallelize, its
optimizer, the [amsp] factors left to the config's data-parallel degrees). Where AMSP does
not pass (``--reference failing``, the default) torchtitan's own trainer runs the same
CPU-sized config (``torchtitan.train.main`` with only this project's CPU shims applied).
Results: PASS, REFUSED (exit 2 with one line ``amsp_dtensor.train: error: ...``) or CRASH
(with the last error line), as tools/titan_features.py classifies them for 0.2.2, and each
side's loss at its last step (each trainer from its own initial weights: not a parity
check; tests/test_titan03.py compares losses from the same weights). Prints a markdown
table with the torch each row ran on (also OUT/lists.md and OUT/lists.json; a run with
``--only`` replaces those rows of an earlier table in OUT, keeping the earlier torchtitan
result where it ran none on the same torch); exit 0
when every config torchtitan's own trainer passes also passes through AMSP.
``--spmd-backend spmd_types`` runs torchtitan's side with 0.3's default backend
(``amsp_config`` gives AMSP's side ``partial_dtensor``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LISTS = ("features", "models")
WORK_ENV = "AMSP_TITAN03_LISTS_WORK"
SPMD_ENV = "AMSP_TITAN03_LISTS_SPMD"
SHIMMED_TITAN = ("from amsp_dtensor.titan.v03 import cpu_compat; cpu_compat.apply(); "
                 "from torchtitan.train import main; main()")
# The ranks torchtitan 0.3's runner (tests/integration_tests/features.py of its source,
# not in the wheel) gives a config where the config's degrees leave it open; every other
# config: the product of its degrees, with an open data_parallel_shard_degree filling 4
# ranks (the runner's default).
RANKS = {
    "llama3_debugmodel_optimizer_bf16_states": 2,
    "llama3_debugmodel_fsdp_reshard_always": 2,
    "llama3_debugmodel_gradient_accumulation": 2,
    "llama3_debugmodel_sft": 2,
    "llama3_debugmodel_seed_checkpoint": 1,
    "llama3_debugmodel_pp2_zbv": 2,
    "llama3_debugmodel_pp2_custom_csv": 2,
    "llama3_debugmodel_float8_emulate_lora_tp2_pp2": 8,
}
STEPS_SCALE = 0.4  # 4 of torchtitan's usual 10 steps


def load_list(name: str) -> dict:
    """name -> config function of ``torchtitan_recipes.tests.<name>`` (the functions it
    defines, in order)."""
    import importlib

    module = importlib.import_module(f"torchtitan_recipes.tests.{name}")
    return {k: f for k, f in vars(module).items()
            if callable(f) and not k.startswith("_") and getattr(f, "__module__", "")
            == module.__name__}


def ranks(name: str, config) -> int:
    if name in RANKS:
        return RANKS[name]
    p = config.parallelism
    n = (max(p.data_parallel_replicate_degree, 1) * max(p.data_parallel_shard_degree, 1)
         * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return max(n, 4) if p.data_parallel_shard_degree == -1 else n


def save_of(name: str) -> str | None:
    """The ``*_save`` config whose dump folder a ``*_load*`` config resumes from."""
    head, sep, _ = name.rpartition("_load")
    return f"{head}_save" if sep else None


def cpu_sized(config, name: str, work: Path):
    """``config`` (torchtitan's Trainer.Config of the test ``name``) at CPU size, in place."""
    data = REPO / "outputs" / "amsp_data"
    t, p = config.training, config.parallelism
    t.steps = max(1, round(t.steps * STEPS_SCALE))
    t.seq_len = max(256, p.context_parallel_degree * 128)
    local = 8 if p.pipeline_parallel_degree > 1 else 2
    if t.global_batch_size > 0:
        t.global_batch_size = t.global_batch_size * local // t.local_batch_size
    t.local_batch_size = local
    t.dtype = t.mixed_precision_param = "float32"
    t.disable_cuda_graphs = True
    p.spmd_backend = os.environ.get(SPMD_ENV, "partial_dtensor")
    config.debug.spmd_typechecking = False
    config.hf_assets_path = str(data / "tokenizer")
    for loader in (config.dataloader, config.validator.dataloader):
        if hasattr(loader, "load_dataset_kwargs") and loader.load_dataset_kwargs.get(
                "data_files"):  # the SFT chat loader's json file
            loader.load_dataset_kwargs = dict(loader.load_dataset_kwargs,
                                              data_files=str(work / "sft_data.json"))
        elif hasattr(loader, "dataset"):
            loader.dataset, loader.dataset_path = "c4_test", str(data / "corpus")
    v = config.validator
    v.freq, v.steps = max(1, min(v.freq, t.steps // 2)), min(max(v.steps, 1), 2)
    config.profiler.profile_freq = min(config.profiler.profile_freq, t.steps)
    config.comm.train_timeout_seconds = max(config.comm.train_timeout_seconds, 600)
    c = config.checkpoint
    if c.initial_load_path:  # the HF save's step folder, in this tool's layout
        save = save_of(name) or name
        saved = config_of(save)
        c.initial_load_path = str(work / save / "amsp" / saved.checkpoint.folder /
                                  f"step-{saved.training.steps}")
    return config


def config_of(name: str):
    for list_name in LISTS:
        functions = load_list(list_name)
        if name in functions:
            return cpu_sized(functions[name](), name, Path(os.environ.get(WORK_ENV, ".")))
    raise AttributeError(name)


def __getattr__(entry: str):
    """``amsp__<list>__<name>`` (AMSP) or ``titan__<list>__<name>`` (torchtitan's own):
    the registry entries the runs name with ``--config``."""
    side, _, rest = entry.partition("__")
    list_name, _, name = rest.partition("__")
    if side not in ("amsp", "titan") or list_name not in LISTS:
        raise AttributeError(entry)

    def build():
        config = config_of(name)
        if side == "titan":
            return config
        from amsp_dtensor.titan.v03.config_registry import amsp_config

        return amsp_config(config)

    build.__name__ = entry
    return build


def sft_data(work: Path, n: int = 64) -> None:
    """A question/answer json (the SFT loader's format) from the offline corpus."""
    lines = (REPO / "outputs" / "amsp_data" / "corpus" / "train.jsonl").read_text().splitlines()
    rows = []
    for line in lines[:n]:
        sentences = [s.strip() for s in json.loads(line)["text"].split(".") if s.strip()]
        rows.append({"question": sentences[0] + "?", "answer": ". ".join(sentences[1:4]) + "."})
    (work / "sft_data.json").write_text(json.dumps(rows))


def run(list_name: str, name: str, work: Path, timeout: int, amsp: bool):
    from titan_features import Run, classify

    try:
        config = config_of(name)
    except Exception as e:  # torchtitan's config function itself (a missing package)
        return Run("CRASH", f"{type(e).__name__}: {e} (building the config)")
    folder = work / (save_of(name) or name)
    dump = folder / ("amsp" if amsp else "torchtitan")
    folder.mkdir(parents=True, exist_ok=True)
    side = "amsp" if amsp else "titan"
    entry = ["--module", "titan03_lists", "--config", f"{side}__{list_name}__{name}",
             "--dump_folder", str(dump)]
    launcher = ["-m", "amsp_dtensor.train"] if amsp else ["--no-python", sys.executable,
                                                          "-c", SHIMMED_TITAN]
    n, pp = ranks(name, config), config.parallelism.pipeline_parallel_degree
    # the first rank of the last stage logs the loss under pipeline parallelism
    shown = ",".join(sorted({"0", str(n // pp * (pp - 1))}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(n), *launcher, *entry]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOG_RANK=shown, **{WORK_ENV: str(work)},
               PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
               TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor_cache"))
    start = time.monotonic()
    proc = subprocess.run(["timeout", str(timeout), *cmd], cwd=work, env=env,
                          capture_output=True, text=True)
    # AMSP's launcher prints the ranks' tracebacks on stdout
    result = classify(subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout, proc.stdout + proc.stderr), amsp)
    result.seconds = time.monotonic() - start
    steps = re.findall(r"step: *(\d+) +loss: *([0-9.]+)",
                       re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr))
    result.loss = max(steps, key=lambda s: int(s[0]))[1] if steps else ""
    result.ranks = n
    (folder / f"{side}-{name}.log").write_text(
        shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lists", default=",".join(LISTS))
    parser.add_argument("--only", default="", help="comma-separated config names")
    parser.add_argument("--reference", choices=("failing", "all", "none"), default="failing",
                        help="where torchtitan's own trainer runs too")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "titan03_lists")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a lock file held (flock) while each config runs")
    parser.add_argument("--spmd-backend", default="partial_dtensor",
                        help="parallelism.spmd_backend of both sides (0.3's default, "
                        "spmd_types, stops on CPU under torch 2.13)")
    args = parser.parse_args(argv)
    import torch

    torch_version = torch.__version__.split("+")[0]
    sys.path.insert(0, str(Path(__file__).parent))
    from titan_features import _locked, own_result, report

    from amsp_dtensor.data import ensure_assets
    from amsp_dtensor.titan.v03 import cpu_compat

    cpu_compat.apply()
    ensure_assets(REPO / "outputs" / "amsp_data")
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ[WORK_ENV] = str(work)
    os.environ[SPMD_ENV] = args.spmd_backend
    sft_data(work)
    todo = [(list_name, name) for list_name in args.lists.split(",")
            for name in load_list(list_name)]
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {n for _, n in todo})
        if unknown:
            raise SystemExit(f"--only: no config named {', '.join(unknown)} in the lists")
        todo = [(l, n) for l, n in todo if n in names]
    rows = []
    for list_name, name in todo:
        with _locked(args.lock):
            amsp = run(list_name, name, work, args.timeout, amsp=True)
            titan = None
            if args.reference == "all" or (args.reference == "failing" and amsp.result != "PASS"):
                titan = run(list_name, name, work, args.timeout, amsp=False)
        row = {"list": list_name, "config": name, "ranks": amsp.ranks, "torch": torch_version,
               "amsp": amsp.result, "detail": amsp.detail, "seconds": round(amsp.seconds),
               "loss": amsp.loss, "torchtitan_loss": None if titan is None else titan.loss,
               "torchtitan": None if titan is None else titan.result,
               "torchtitan_detail": None if titan is None else titan.detail}
        rows.append(row)
        print(json.dumps(row), flush=True)
    earlier = work / "lists.json"
    if args.only and earlier.is_file():  # a rerun of some configs: the others' rows kept
        by_name = {r["config"]: r for r in json.loads(earlier.read_text())}
        for r in rows:  # a rerun without the reference keeps the earlier reference's
            old = by_name.get(r["config"], {})  # result, if it ran on the same torch
            if (r["torchtitan"] is None and old.get("torchtitan") is not None
                    and old.get("torch") == r["torch"]):
                r.update({k: old[k] for k in ("torchtitan", "torchtitan_detail",
                                              "torchtitan_loss")})
            by_name[r["config"]] = r
        order = [n for l in LISTS for n in load_list(l)]
        rows = sorted(by_name.values(), key=lambda r: order.index(r["config"]))
    columns = ["list", "config", "torch", "ranks", "AMSP", "plan / reason", "s", "last loss",
               "torchtitan's own", "its last loss"]
    return report(rows, "config", columns, lambda r: [
        r["list"], r["config"], r.get("torch", ""), r["ranks"], r["amsp"], r["detail"],
        r["seconds"], r["loss"], own_result(r), r["torchtitan_loss"] or ""], work / "lists")


if __name__ == "__main__":
    sys.exit(main())
