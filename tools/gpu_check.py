"""The engine on one device, as one rank of a larger job (torch's fake process group):
CUDA stream order and the step lifecycle, in one command.

    python tools/gpu_check.py                 # CUDA if available, else the CPU part
    python tools/gpu_check.py --mutant drop-copy-in-wait   # must FAIL check 1 on CUDA

For a plan with a post-step all-gather (s_os > s_p) and overlap_param_update=True, units cut
as torchtitan cuts them: 1. every unit's FSDP2 all-gather input is the P shard after the
unpack, even with the unpack delayed on the compute stream (the copy-in stream waits for
it, engine/streams.py rule 4; the mutant removes that wait; units with s_p = 1 hold whole
parameters and have no FSDP all-gather, so it is checked on FSDP units only); 2. the P shard holds the fp32
masters' new values after the landing; 3. on CUDA the gradient path ran on the grad stream
and the synced G is readable after backward (rules 1 to 3); 4. after backward every unit is
SYNCED or REDUCING, SYNCED once those complete, UPDATED after landing. Exit 0 and
"gpu_check: OK" when all hold; one line per failure otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--rank", type=int, default=5)
    parser.add_argument("--plan", default="2,2,8")
    parser.add_argument("--sleep-cycles", type=int, default=200_000_000)
    parser.add_argument("--mutant", choices=("drop-copy-in-wait",),
                        help="run with the engine's copy-in wait removed (check 1 must fail)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device", file=sys.stderr)
        return 2

    import amsp_dtensor as amsp
    from amsp_dtensor.engine import collectives, streams
    from amsp_dtensor import compat
    from amsp_dtensor.engine.handle import root_state
    from amsp_dtensor.engine.lifecycle import StepState
    from amsp_dtensor.testing.scenarios import shard_model
    from amsp_dtensor.testing.tiny_llama import TinyLlama, TinyLlamaConfig, loss_fn

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    compat.init_fake_process_group(args.rank, args.world)
    if args.mutant == "drop-copy-in-wait":
        streams.order_before_copy_in = lambda module: None
    _fill_engine_all_gathers(collectives)
    plan = amsp.ShardingPlan(*(int(x) for x in args.plan.split(",")))
    mesh = amsp.init_mesh(plan, ranks_per_node=args.ranks_per_node, device_type=device.type)
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(dim=256, ffn_dim=512, n_layers=4, vocab_size=512)
    model = TinyLlama(cfg).to(device)
    shard_model(model, mesh, plan, layout="titan")
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap_param_update=True)
    state = root_state(model)
    failures = []
    captured = _capture_all_gather_inputs(state)

    tokens = torch.randint(0, cfg.vocab_size, (2, 33), device=device)
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    if not all(u.ready_to_step() for u in state.units):
        failures.append("a unit is neither SYNCED nor REDUCING with collectives in flight "
                        "after backward")
    state.finish_sync()
    if any(u.step_state is not StepState.SYNCED for u in state.units):
        failures.append("a unit is not SYNCED once its gradient collectives completed")
    if device.type == "cuda":
        if state.grad_stream is None:
            failures.append("no grad stream on CUDA")
        synced = [u.synced_grad for u in state.units]
        if any(g is None or not torch.isfinite(g.float()).all() for g in synced):
            failures.append("synced G missing or not finite on the compute stream")
    optim.step()
    masters = {id(u): [m.to_local().detach().clone() for m in ms] for u, ms in optim._unit_masters}
    captured.clear()
    checked = {"all-gather input": 0, "landed P rows": 0}
    if device.type == "cuda":
        _delay_unpacks(state, args.sleep_cycles)
    with torch.no_grad():
        model(tokens[:, :-1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    for unit in state.units:
        if unit.step_state is not StepState.UPDATED:
            failures.append(f"{unit.name}: {unit.step_state.value} after the forward")
        if unit.uses_fsdp:  # check 1; a unit with s_p = 1 holds whole params: no all-gather
            checked["all-gather input"] += 1
            shard = torch.cat([compat.fsdp_sharded_storage(fp).reshape(-1)
                               for fp in compat.fsdp_params(unit.module)])
            inputs = captured.get(id(unit.module), [])
            if not inputs:
                failures.append(f"{unit.name}: no all-gather captured")
            elif not torch.equal(inputs[0], shard):
                failures.append(f"{unit.name}: the all-gather input is not the landed P "
                                "shard (copy-in ran before the unpack)")
        checked["landed P rows"] += 1
        for local, master in zip(_os_rows_of_p(unit), masters[id(unit)]):
            if not torch.equal(local, master.to(local.dtype).reshape(local.shape)):
                failures.append(f"{unit.name}: P rows differ from the new masters")
                break
    for line in failures:
        print(f"gpu_check: FAIL {line}")
    if not failures:
        print(f"gpu_check: OK ({args.device}, rank {args.rank} of {args.world}, plan "
              f"{args.plan}, {len(state.units)} units"
              + (f", mutant {args.mutant}" if args.mutant else "") + "); checked per unit: "
              + ", ".join(f"{what} {n}" for what, n in checked.items()))
    return 1 if failures else 0


def _delay_unpacks(state, cycles: int) -> None:
    """Queue a sleep on the compute stream in each unit's forward pre-hook, ahead of the
    engine's own (which lands the update): FSDP2's root pre-forward has already made the
    copy-in stream wait for the compute stream, so only the engine's wait after the
    unpack keeps the copy-in from reading the old shard while the unpack sleeps."""
    from amsp_dtensor import compat

    for unit in state.units:
        for module in unit.modules:
            module.register_forward_pre_hook(lambda *_: compat.cuda_sleep(cycles), prepend=True)


def _fill_like_every_rank(output: torch.Tensor, input: torch.Tensor) -> None:
    """An all-gather's output as if every rank held this rank's input (the fake backend
    moves no data and leaves the output as allocated)."""
    output.view(-1, input.numel()).copy_(input.reshape(1, -1).expand(
        output.numel() // input.numel(), -1))


def _fill_chunk(output: torch.Tensor, input: torch.Tensor) -> None:
    """A reduce-scatter's output filled with the first chunk of its input (finite values;
    the fake backend leaves the output as allocated)."""
    output.view(-1).copy_(input.reshape(-1)[:output.numel()])


def _fill_engine_all_gathers(collectives) -> None:
    """The outputs of the collectives the fake backend leaves as allocated, filled: the
    engine's all-gathers (_fill_like_every_rank), so the unpack is checkable, and its and
    FSDP2's reduce-scatters (_fill_chunk); FSDP2's all-gathers in
    _capture_all_gather_inputs. Left unfilled, the step reads whatever memory the
    allocator hands out, and NaN there made the masters NaN and every equality check fail
    in about 1 run of 4 (seen on torch 2.11, with NaN in the masters on each failing run)."""
    all_gather, reduce_scatter = (collectives.Collectives.all_gather,
                                  collectives.Collectives.reduce_scatter)
    fsdp_reduce_scatter = collectives.RecordingReduceScatter.__call__

    def filled_all_gather(self, output, input, dim, phase, codec=None):
        pending = all_gather(self, output, input, dim, phase, codec)
        _fill_like_every_rank(output, input)
        return pending

    def filled_reduce_scatter(self, output, input, dim, phase):
        pending = reduce_scatter(self, output, input, dim, phase)
        _fill_chunk(output, input)
        return pending

    def filled_fsdp_reduce_scatter(self, output_tensor, input_tensor, group, op,
                                   async_op=False):
        work = fsdp_reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)
        _fill_chunk(output_tensor, input_tensor)
        return work

    collectives.Collectives.all_gather = filled_all_gather
    collectives.Collectives.reduce_scatter = filled_reduce_scatter
    collectives.RecordingReduceScatter.__call__ = filled_fsdp_reduce_scatter


def _capture_all_gather_inputs(state) -> dict:
    """Each FSDP unit's all-gather input, cloned on the stream the all-gather runs on."""
    from amsp_dtensor.engine.collectives import RecordingAllGather

    captured: dict = {}
    for unit in state.units:
        if not unit.uses_fsdp:
            continue

        class Capturing(RecordingAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False,
                         _key=id(unit.module)):
                captured.setdefault(_key, []).append(input_tensor.detach().clone())
                work = super().__call__(output_tensor, input_tensor, group, async_op)
                _fill_like_every_rank(output_tensor, input_tensor)
                return work

        unit.module.set_custom_all_gather(Capturing(state.collectives))
    return captured


def _os_rows_of_p(unit) -> list[torch.Tensor]:
    """This rank's OS rows inside its P rows, per param (what the masters hold)."""
    from amsp_dtensor.engine.layouts import chunk_rows

    k, index = unit.info.os_split
    out = []
    for local, rows in zip(unit.local_params(), unit.p_layout.params):
        start, length = chunk_rows(rows.rows, k)[index]
        out.append(local.reshape(rows.rows, rows.cols)[start:start + length])
    return out


if __name__ == "__main__":
    sys.exit(main())
