"""Save and resume an AMSP job with torch.distributed.checkpoint (DCP).

``save(directory, step, model, optimizer)`` writes ``directory/step-<step>``;
``latest_step(directory)`` names the newest *complete* one; ``load(path, model, optimizer)``
checks that it fits, then loads it under this job's plan and world size, whatever they
were when it was saved. The model's state dict holds FSDP2's DTensors (P layout) and the
AMSPOptimizer's holds fp32 masters and optimizer states as DTensors in the OS layout, so
DCP reshards both: each rank reads the rows its own shards cover.

[Note: a checkpoint is complete when its .metadata exists]
DCP writes every rank's data files first and the coordinator writes ``.metadata`` last,
to a temporary name renamed into place. A save killed at any point therefore leaves a
folder without ``.metadata``, and ``latest_step`` (like torchtitan's checkpointer) skips
it: a resume picks the previous complete checkpoint. ``save`` never writes into a folder
that already holds a complete checkpoint.

[Note: every rank decides whether a checkpoint fits, then they agree]
A checkpoint that does not fit the model (other shapes, missing or extra entries, another
optimizer or optimizer settings, a model-only save) would otherwise fail inside DCP's
collective load planning, with one traceback per rank, or load part of the model
silently. ``load`` compares the checkpoint's metadata (a local file read) with this job's
state dict, then the ranks exchange their verdicts (and the folder each is loading) in one
all-gather before DCP starts: if any rank found a misfit, or could not read the folder,
every rank raises the same one-line ``CheckpointMismatch``; no rank is left in DCP's
collectives while another has given up.

What a checkpoint holds: the model, the optimizer (unless ``optimizer=None``), the step,
each rank's RNG state (torch CPU, and CUDA when present; restored when the world size is
unchanged), ``extra`` (the caller's values every rank holds alike, e.g. the global
sample count: DCP saves a key all ranks hold once) and ``rank_extra`` (each rank's own,
e.g. its data loader position; saved per rank and restored on the same world size only),
and with ``amsp.set_compression(grads=...)`` each rank's error-feedback residuals, restored
when the plan, world and codec are the ones they were saved under (otherwise they start
from zero, with one warning).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .engine import handle

__all__ = ["CheckpointMismatch", "save", "load", "latest_step", "step_path"]

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_METADATA = ".metadata"


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit this model, optimizer or job (one line says what)."""


def step_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / _METADATA).is_file()


def latest_step(directory: str | Path) -> int | None:
    """The newest step under ``directory`` whose checkpoint is complete (None if none)."""
    steps = _complete_steps(Path(directory))
    return steps[-1] if steps else None


def _complete_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    steps = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and is_complete(child):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _optimizer_name(optimizer) -> str:
    cls = getattr(optimizer, "optimizer_class", None) or type(optimizer)
    return cls.__name__


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's torch RNG state: CPU, and the current CUDA device's when there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _job_state(model, optimizer, step: int, extra: dict | None,
               rank_extra: dict | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    state["amsp"] = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": _world_size(),
        "optimizer_class": _optimizer_name(optimizer) if optimizer is not None else "",
    }
    # One key per rank: DCP keeps each (a key every rank holds is saved once).
    state["rng"] = {f"rank{_rank()}": rng_state()}
    if extra is not None:
        state["extra"] = extra
    if rank_extra is not None:
        state["rank_extra"] = {f"rank{_rank()}": rank_extra}
    entry = residual_entry(model)
    if entry is not None:
        state["residuals"] = entry
    return state


# [Note: error-feedback residuals in a checkpoint]
# Under amsp.set_compression(grads=...) each rank carries what its compressed sends left
# out; they are per rank and laid out by plan, world and codec, so they are saved under a
# key naming those three, one "rank<r>" entry per rank, and restored only into a job with
# the same key. Any other job (or a checkpoint without them) starts them from zero with
# one warning: losing them costs a little accuracy for a few steps, never correctness.
# Both savers use these helpers: save/load below and torchtitan's checkpointer (through
# titan/optimizer.py, under "optimizer.amsp_residuals.<part>").


def residual_entry(model) -> dict | None:
    """``{"key": plan/world/codec, "rank<r>": {"<unit>.<stage>": tensor}}``: this rank's
    error-feedback residuals (None: the model does not compress its gradients)."""
    root = handle.root_of(model)
    if root is None or root.compression.grads is None:
        return None
    plan, expert = root.info.plan, root.info.expert
    key = (f"{plan.name} on {plan.world_size} ranks, {plan.ranks_per_node} per node, "
           f"grads={root.compression.grads}")
    if expert is not None:  # the experts' residuals are laid out by their own plan and ep
        key += (f", experts {expert.plan.name} on {expert.plan.world_size} ranks x ep "
                f"{expert.tp}")
    return {"key": key, f"rank{_rank()}": {f"{i}.{name}": r for i, unit in enumerate(root.units)
                                           for name, r in unit.residual_state().items()}}


def fit_residuals(path: str | Path, entry: dict, at: tuple[str, ...],
                  metadata: Metadata | None = None) -> str | None:
    """Make ``entry`` (``residual_entry``'s, at the nested keys ``at`` of the saved state:
    ``("residuals",)`` here) loadable from the checkpoint ``path`` (whose ``metadata`` the
    caller may have read already): this rank's tensors allocated from its metadata.
    Returns why they cannot load (saved for another plan, world or codec, or not saved):
    the caller then leaves the entry out and warns once."""
    metadata = metadata or FileSystemReader(str(path)).read_metadata()
    saved, stored = None, ".".join(at)  # DCP's flattened name of the entry
    if f"{stored}.key" in metadata.state_dict_metadata:
        info: dict = {"key": ""}
        nested = info
        for part in reversed(at):
            nested = {part: nested}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(nested, checkpoint_id=path, no_dist=True)
        saved = info["key"]
    if saved != entry["key"]:
        return (f"{path} holds error-feedback residuals for {saved}" if saved else
                f"{path} holds no error-feedback residuals") + (
                f" and this job runs {entry['key']}: they start from zero")
    prefix = f"{stored}.rank{_rank()}."
    entry[f"rank{_rank()}"] = {
        key[len(prefix):]: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    return None


def restore_residuals(model, entry: dict) -> None:
    """Give each unit its residuals from a loaded ``entry`` (``fit_residuals`` passed)."""
    mine = entry[f"rank{_rank()}"]
    for i, unit in enumerate(handle.root_state(model).units):
        unit.load_residuals({key.split(".", 1)[1]: value for key, value in mine.items()
                             if key.split(".", 1)[0] == str(i)})


def save(directory: str | Path, step: int, model, optimizer=None, *, extra: dict | None = None,
         rank_extra: dict | None = None, storage_writer=None) -> Path:
    """Save model, optimizer, step, RNG state, ``extra`` (alike on every rank) and
    ``rank_extra`` (this rank's own) to ``directory/step-<step>`` (a collective: every rank
    calls it). ``storage_writer``: a DCP StorageWriter for that path (default:
    FileSystemWriter)."""
    path = step_path(directory, step)
    if is_complete(path):
        raise FileExistsError(f"{path} already holds a complete checkpoint; save step {step} "
                              f"elsewhere or remove it first")
    state = _job_state(model, optimizer, step, extra, rank_extra)
    dcp.save(state, checkpoint_id=path, storage_writer=storage_writer)
    return path


def load(path: str | Path, model, optimizer=None, *, extra: dict | None = None,
         rank_extra: dict | None = None) -> int:
    """Load a checkpoint written by ``save`` (under any plan and world size) into ``model``
    and ``optimizer`` and, in place, into ``extra`` and ``rank_extra``; returns its step.

    Raises CheckpointMismatch, the same line on every rank and before DCP starts, when it
    does not fit. ``optimizer=None`` loads the weights only; build the AMSPOptimizer
    afterwards, since it takes its fp32 masters from the parameters when it is built.
    ``rank_extra`` is loaded on the same world size only (on another, rank 0 warns and the
    values passed in stay), as is the RNG state.
    """
    path = Path(path)
    error, saved, state = None, None, None
    try:
        check_complete(path)
        model_state = handle.root_of(model)
        if optimizer is None and model_state is not None and model_state.optimizer_bound:
            raise CheckpointMismatch(
                "this model already has an AMSPOptimizer, whose master weights would keep "
                "their old values: pass it as optimizer=, or load the weights before building it")
        state = _job_state(model, optimizer, 0, extra, rank_extra)
        saved = _read_job_info(path)
        check_fits(path, state, saved)
    except (CheckpointMismatch, OSError) as e:
        error = str(e) if isinstance(e, CheckpointMismatch) else f"{path}: {e}"
    _agree(path, error)
    same_world = saved["world_size"] == _world_size()
    for key in ("rng", "rank_extra"):
        if not same_world:
            state.pop(key, None)
    residuals_reset = fit_residuals(path, state["residuals"], ("residuals",)) if (
        "residuals" in state) else None
    if residuals_reset:
        state.pop("residuals")
    dcp.load(state, checkpoint_id=path)
    if "residuals" in state:
        restore_residuals(model, state["residuals"])
    if residuals_reset and _rank() == 0:
        warnings.warn(residuals_reset, stacklevel=2)
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    else:
        model.load_state_dict(state["model"])
    if same_world:
        set_rng_state(state["rng"][f"rank{_rank()}"])
        if rank_extra is not None:
            rank_extra.update(state["rank_extra"][f"rank{_rank()}"])
    elif _rank() == 0:
        warnings.warn(f"{path} was saved on {saved['world_size']} ranks and is loaded on "
                      f"{_world_size()}: the RNG state{' and rank_extra are' if rank_extra is not None else ' is'} "
                      f"not restored", stacklevel=2)
    return int(saved["step"])


def _agree(path: Path, error: str | None) -> None:
    """Every rank raises the same CheckpointMismatch if any rank found one, or if the ranks
    are not loading the same folder (one all-gather; a no-op without a process group)."""
    if not dist.is_initialized() or _world_size() == 1:
        if error:
            raise CheckpointMismatch(error)
        return
    verdicts: list = [None] * _world_size()
    dist.all_gather_object(verdicts, (str(path.resolve()), error))
    errors = [(rank, e) for rank, (_, e) in enumerate(verdicts) if e]
    if errors:
        rank, first = errors[0]
        alike = len(errors) == len(verdicts) and all(e == first for _, e in errors)
        raise CheckpointMismatch(first if alike else f"on rank {rank}: {first}")
    folders = sorted({folder for folder, _ in verdicts})
    if len(folders) > 1:
        raise CheckpointMismatch(f"the ranks are loading different checkpoints ({', '.join(folders)}): "
                                 f"pick the step once (e.g. latest_step on rank 0, broadcast)")


def check_complete(path: str | Path) -> None:
    """Raise CheckpointMismatch unless ``path`` holds a complete checkpoint."""
    path = Path(path)
    if is_complete(path):
        return
    if not path.exists():
        raise CheckpointMismatch(f"{path}: no such checkpoint")
    complete = [f"step-{s}" for s in _complete_steps(path.parent)]
    others = f"; complete ones beside it: {', '.join(complete)}" if complete else ""
    raise CheckpointMismatch(f"{path} is not a complete checkpoint (no {_METADATA}: its save "
                             f"was interrupted){others}")


def _read_job_info(path: Path) -> dict[str, Any]:
    """The "amsp" entry, read by this rank alone (no collective)."""
    info = {"format": 0, "step": 0, "world_size": 0, "optimizer_class": ""}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"amsp": info}, checkpoint_id=path, no_dist=True)
    except Exception as e:  # not written by save(): a torchtitan or hand-made checkpoint
        raise CheckpointMismatch(f"{path} was not written by amsp_dtensor.checkpoint.save "
                                 f"(no readable 'amsp' entry: {type(e).__name__})") from None
    return info


def _tensor_entries(prefix: str, tree: Any, out: dict[str, tuple]) -> None:
    """DCP's flattened key -> global shape for every tensor in ``tree``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _tensor_entries(f"{prefix}.{key}" if prefix else str(key), value, out)
    elif isinstance(tree, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple))
                                                 for v in tree):
        for index, value in enumerate(tree):
            _tensor_entries(f"{prefix}.{index}" if prefix else str(index), value, out)
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tuple(tree.shape)


def check_fits(path: str | Path, state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Raise CheckpointMismatch (one line) if the checkpoint at ``path`` cannot be loaded
    into ``state`` (as built by save's _job_state) exactly."""
    if saved["format"] != FORMAT_VERSION:
        raise CheckpointMismatch(f"{path} has checkpoint format {saved['format']}; this "
                                 f"version of amsp_dtensor reads format {FORMAT_VERSION}")
    has_optim = bool(saved["optimizer_class"])
    if "optim" in state and not has_optim:
        raise CheckpointMismatch(f"{path} holds model weights only: load it with optimizer=None "
                                 f"and build the AMSPOptimizer afterwards")
    if "optim" in state and saved["optimizer_class"] != state["amsp"]["optimizer_class"]:
        raise CheckpointMismatch(
            f"{path} was saved with {saved['optimizer_class']} and this optimizer is "
            f"{state['amsp']['optimizer_class']}: build AMSPOptimizer(model, "
            f"torch.optim.{saved['optimizer_class']}, ...) to resume, or load with "
            f"optimizer=None to keep only the weights")
    check_entries_fit(path, state, [("model", "model", ""),
                                    ("optim.state", "optimizer state", OTHER_SETTINGS),
                                    ("extra", "extra", "")])
    # rank_extra: this rank's own keys, checked when they will be loaded (same world size)
    if "rank_extra" in state and saved["world_size"] == _world_size():
        check_entries_fit(path, state, [(f"rank_extra.rank{_rank()}", "rank_extra", "")])


OTHER_SETTINGS = " (other optimizer settings?)"


def check_entries_fit(path: str | Path, state: dict[str, Any],
                      sections: list[tuple[str, str, str]], others: tuple[str, ...] = (),
                      metadata: Metadata | None = None, partial: bool = False) -> None:
    """Compare the tensors of ``state`` with the checkpoint's metadata (a local file read,
    unless the caller passes ``metadata``), one section at a time: ``(key prefix, what to
    call it, hint)``. The prefix "" means the tensors at the top level (where torchtitan
    keeps the model's), compared with every stored key outside the other sections and
    outside ``others``: prefixes of entries that are not compared, on either side (e.g.
    torchtitan's "lr_scheduler", or inside a section, "optimizer.amsp_residuals": per-rank
    entries fitted on their own). Raises CheckpointMismatch on the first missing entry,
    unexpected entry or other shape."""
    metadata = metadata or FileSystemReader(str(path)).read_metadata()
    stored = {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata)}
    wanted_all: dict[str, tuple] = {}
    _tensor_entries("", state, wanted_all)
    nested = [p for p, _, _ in sections if p] + list(others)
    for prefix, what, hint in sections:
        if prefix:
            if prefix.split(".")[0] not in state:
                continue
            inner = tuple(o + "." for o in others if o.startswith(prefix + "."))  # not compared
            wanted = {k: v for k, v in wanted_all.items()
                      if k.startswith(prefix + ".") and not k.startswith(inner)}
            have = {k: v for k, v in stored.items()
                    if k.startswith(prefix + ".") and not k.startswith(inner)}
        else:
            wanted = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
            have = {k: v for k, v in stored.items()
                    if not any(k.startswith(p.split(".")[0] + ".") for p in nested)}
        if partial:
            have = {k: v for k, v in have.items() if k in wanted}
        _compare(path, what, prefix, wanted, have, hint)


def _compare(path, what: str, section: str, wanted: dict, have: dict, hint: str) -> None:
    def name(key: str) -> str:
        return key[len(section) + 1:] if section else key

    missing = sorted(set(wanted) - set(have))
    if missing:
        raise CheckpointMismatch(
            f"{path} does not fit: {len(missing)} {what} entr{'y' if len(missing) == 1 else 'ies'} "
            f"of this job missing from it{hint} (first: {name(missing[0])})")
    unexpected = sorted(set(have) - set(wanted))
    if unexpected:
        raise CheckpointMismatch(
            f"{path} does not fit: it has {len(unexpected)} {what} "
            f"entr{'y' if len(unexpected) == 1 else 'ies'} this job lacks "
            f"(first: {name(unexpected[0])})")
    for key in sorted(wanted):
        if wanted[key] != have[key]:
            raise CheckpointMismatch(
                f"{path} does not fit: {what} {name(key)} has shape {list(have[key])} in the "
                f"checkpoint and {list(wanted[key])} here")
