"""Measuring the machine a job runs on: ``dreampipe calibrate``, and its quick subset at start-up.

The ranks of one process group measure every figure of a
:class:`~dreampipe.machine.machine_file.MachineFile` together (``L`` workers
per node, ranks ``0..L-1`` on the first node, as torchrun numbers them): the
co-run on ranks 0 and 1, then per level a ping-pong between its first two
members and an all-reduce among all of them, with the step and stash-copy
rates. Rank 0 takes part in every measurement and gets every result. What
each figure is and how a probe is sized: docs/design.md §9.1.

Locally the ranks are processes started here
(:func:`~dreampipe.runtime.processes.run_processes`); under torchrun they
are torchrun's, joined through its agent's store for as long as they measure.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import LocalCalibration
from dreampipe.machine.corun import corun_in_group
from dreampipe.machine.machine_file import (
    LinkFigures,
    MachineFile,
    default_path,
    here,
    load_machine_file,
    typical_how,
)
from dreampipe.machine.pingpong import LineFit, ping_pong
from dreampipe.machine.rates import HostRates, measure_rates
from dreampipe.machine.split_layers import SplitLayerCost, measure_split_chains, split_layer_cost
from dreampipe.machine.timers import timer_for
from dreampipe.machine.torchrun import in_torchrun
from dreampipe.quantities import format_bytes
from dreampipe.runtime.backend import (
    Backend,
    backend_for_node,
    check_measurable,
    gpus_here,
    group_device,
)
from dreampipe.runtime.processes import run_processes

__all__ = ["FULL", "QUICK", "Probe", "calibrate_local", "calibrate_torchrun", "describe",
           "describe_level", "local_machine", "machine_for_run", "machine_in_group"]

log = logging.getLogger(__name__)

Say = Callable[[str], None]


@dataclass(frozen=True)
class Probe:
    """How much to measure: ping-pong sizes (bytes, ascending) and seconds per size, the
    longest round trip before larger sizes are skipped, the all-reduce's target seconds per
    round and most bytes, timed rounds (at least) and seconds, co-run repeats, timed rounds
    of each chain of split layers."""

    sizes: tuple[int, ...]
    pingpong_s: float
    budget_s: float
    allreduce_target_s: float
    allreduce_max_bytes: int
    rounds: int
    min_time_s: float
    corun_repeats: int
    split_rounds: int


#: ``dreampipe calibrate``: seconds on two CPU cores.
FULL = Probe((4 << 10, 64 << 10, 1 << 20, 8 << 20), pingpong_s=0.2, budget_s=0.5,
             allreduce_target_s=0.2, allreduce_max_bytes=64 << 20, rounds=3, min_time_s=0.5,
             corun_repeats=5, split_rounds=15)
#: At start-up, without a machine file.
QUICK = Probe((4 << 10, 256 << 10, 2 << 20), pingpong_s=0.0, budget_s=0.5,
              allreduce_target_s=0.1, allreduce_max_bytes=16 << 20, rounds=2, min_time_s=0.0,
              corun_repeats=3, split_rounds=5)

#: The co-run slowdown's workload: the zoo mlp at the train command's default batch.
_CORUN_MODEL, _CORUN_BATCH = "mlp", 32
_FLOATS_PER_TENSOR = 1 << 20  # 4 MB tensors, the runtime's bucket size
_SEND_HOW = ("isend posted at the ping-pong's sizes, wall clock, median per size, fitted "
             "overhead + bytes / copy bandwidth")


@dataclass(frozen=True)
class _Job:
    world: int
    per_node: int
    probe: Probe
    backend: Backend
    #: Where rank 0 of processes started here sends its progress lines.
    progress: Any = None


def calibrate_local(workers: int, probe: Probe = FULL, say: Say | None = None) -> MachineFile:
    """Measure this machine with ``workers`` processes started here: a GPU each where there
    are as many GPUs, else on the CPU with gloo (:mod:`~dreampipe.runtime.backend`)."""
    if workers < 2:
        raise ConfigError(f"workers={workers}: links are measured between 2 workers or more",
                          "workers")
    check_measurable(workers)
    backend = backend_for_node(workers)
    job = _Job(workers, workers, probe, backend)
    _tell(say, f"measuring {workers} local workers ({job.backend.value}): co-run slowdown, "
               "ping-pong, all-reduce, step and stash-copy rates")
    lines, progress = mp.Pipe(duplex=False)
    relay = threading.Thread(target=_relay, args=(lines, say), daemon=True)
    relay.start()
    try:
        found = run_processes(_local_rank, workers, dataclasses.replace(job, progress=progress),
                              threads=backend.threads, deadline_s=300.0,
                              error=ConfigError)[0]
    finally:
        progress.close()  # the ranks' ends are closed: the relay reads to the end
        relay.join(timeout=5.0)
        lines.close()
    assert isinstance(found, MachineFile)
    return found


def _relay(lines: Any, say: Say | None) -> None:
    """Say each line rank 0 sends, as it comes, until every sender has closed."""
    while True:
        try:
            line = lines.recv()
        except (EOFError, OSError):
            return
        _tell(say, line)


def calibrate_torchrun(probe: Probe = FULL, say: Say | None = None) -> MachineFile | None:
    """Measure the machines of this torchrun job, both levels when it spans several nodes
    (every rank calls it); rank 0 gets the file, the others None."""
    job = _torchrun_job(probe)
    owns = _join_torchrun()
    try:
        return _measure(job, say if dist.get_rank() == 0 else None)
    finally:
        if owns:
            dist.destroy_process_group()


def machine_for_run(workers: int, *, nodes: int = 1, say: Say | None = None
                    ) -> LocalCalibration:
    """The calibration a job plans with: the machine file's, else measured now (quickly).

    Under torchrun every rank must call it (the measurement is collective,
    and rank 0's file decides); locally only the launching process does.
    """
    if not in_torchrun():
        return local_machine(workers, say=say)
    owns = _join_torchrun()
    try:
        return machine_in_group(nodes=nodes, say=say)
    finally:
        if owns:
            dist.destroy_process_group()


def local_machine(workers: int, *, say: Say | None = None) -> LocalCalibration:
    """The machine file's calibration, else a quick one of ``workers`` processes started
    here (2 at the least, a GPU each where there are GPUs), once per process."""
    found = load_machine_file()
    if found is not None:
        return found.calibration()
    gpus = gpus_here()
    count = max(2, min(workers, gpus) if gpus else 2)
    if count not in _quick_machines:
        _missing(say, "")
        _quick_machines[count] = calibrate_local(count, QUICK)
    return _quick_machines[count].calibration()


def machine_in_group(*, nodes: int = 1, say: Say | None = None) -> LocalCalibration:
    """The calibration for a job of the default group's ranks (every rank calls it): rank
    0's machine file when it has the levels ``nodes`` needs, else measured now by all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [None]
    if rank == 0:
        found = load_machine_file()
        if found is not None and (nodes <= 1 or found.nodes is not None):
            box[0] = found.calibration()
        elif world < 2:  # no link between ranks here: measure local processes instead
            box[0] = local_machine(2, say=say)
        else:
            _missing(say, "" if found is None else
                     f" with a link between nodes (this job runs on {nodes})")
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        per_node = world // nodes if nodes > 1 and world % nodes == 0 else world
        made = _measure(_Job(world, per_node, QUICK, Backend(dist.get_backend())),
                        say if rank == 0 else None)
        box = [None if made is None else made.calibration()]
        dist.broadcast_object_list(box, src=0)
    assert isinstance(box[0], LocalCalibration)
    return box[0]


def describe(found: MachineFile) -> list[str]:
    """One line per level measured, and one of the rates."""
    lines = [describe_level(name, level) for name, level in
             (("node", found.node), ("nodes", found.nodes)) if level is not None]
    lines.append(f"SGD step {format_bytes(found.step_bandwidth)}/s, stash copy "
                 f"{format_bytes(found.stash_copy_bandwidth)}/s, co-run slowdown "
                 f"x{found.corun_slowdown:.3f}, send post {found.send_overhead_s * 1e6:.0f} us "
                 f"+ {format_bytes(found.send_copy_bandwidth)}/s")
    if found.split_layer_forward_s is not None and found.split_layer_backward_s is not None:
        lines.append(f"tensor-split layer: forward {found.split_layer_forward_s * 1e3:.3f} ms, "
                     f"backward {found.split_layer_backward_s * 1e3:.3f} ms beyond its compute")
    return lines


def describe_level(name: str, level: LinkFigures) -> str:
    """A line of one level's figures (``name``: ``node`` or ``nodes``)."""
    where = "inside a node" if name == "node" else "between nodes"
    return (f"{where} ({level.workers} {'workers' if name == 'node' else 'nodes'}, "
            f"{level.backend.value}): all-reduce {format_bytes(level.allreduce_bandwidth)}/s, "
            f"point-to-point {format_bytes(level.p2p_bandwidth)}/s, latency "
            f"{level.latency_s * 1e6:.0f} us")


#: Quick calibrations made in this process, by workers measured.
_quick_machines: dict[int, MachineFile] = {}


def _missing(say: Say | None, why: str) -> None:
    line = (f"no machine file at {default_path()}{why}: measuring this machine for a few "
            "seconds; run 'dreampipe calibrate' once to measure it thoroughly and skip this")
    if say is None:
        log.warning("%s", line)
    else:
        log.info("%s", line)
        say(line)


def _tell(say: Say | None, line: str) -> None:
    log.info("%s", line)
    if say is not None:
        say(line)


def _torchrun_job(probe: Probe) -> _Job:
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    per_node = local if local > 0 and world % local == 0 else world
    if world < 2:
        raise ConfigError("torchrun started 1 process: links are measured between 2 or more; "
                          "use --nproc-per-node 2 or more nodes")
    return _Job(world, per_node, probe, backend_for_node(per_node))


def _join_torchrun() -> bool:
    """Join torchrun's ranks in a group of their own, through the agent's store under a
    prefix of their own (the job's group joins later under its own); False if one exists."""
    if dist.is_initialized():
        return False
    backend = backend_for_node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend is Backend.NCCL:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend.value)
        return True
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=300))
    prefix = f"dreampipe/calibrate-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    dist.init_process_group(backend.value, store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    return True


def _local_rank(rank: int, world: int, job: _Job) -> MachineFile | None:
    if job.backend is Backend.NCCL:
        torch.cuda.set_device(rank)
    dist.init_process_group(job.backend.value, rank=rank, world_size=world)
    say = job.progress.send if rank == 0 and job.progress is not None else None
    try:
        return _measure(dataclasses.replace(job, progress=None), say)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class _Level:
    figures: LinkFigures
    rates: HostRates
    send: LineFit
    split: SplitLayerCost | None


def _measure(job: _Job, say: Say | None) -> MachineFile | None:
    """Every figure, by every rank of the default group; rank 0 gets the file. Its probes
    draw random inputs on generators of their own: a run's draws (dropout, say) are the
    same whether or not the machine was measured first."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        return _measured(job, say)


def _measured(job: _Job, say: Say | None) -> MachineFile | None:
    rank, per_node, world = dist.get_rank(), job.per_node, job.world
    device = group_device()
    node_ranks, leaders = list(range(per_node)), list(range(0, world, per_node))
    node_group = dist.new_group(node_ranks) if per_node > 1 else None
    nodes_group = dist.new_group(leaders) if len(leaders) > 1 else None
    corun = None
    if device.type == "cpu" and per_node > 1:
        corun = corun_in_group(_CORUN_MODEL, _CORUN_BATCH, repeats=job.probe.corun_repeats)
        if corun is not None:
            _tell(say, f"co-run: {corun.describe()}")
    levels: dict[str, _Level | None] = {"node": None, "nodes": None}
    for name, members, group in (("node", node_ranks, node_group),
                                 ("nodes", leaders, nodes_group)):
        if group is not None and rank in members:
            level = levels[name] = _level(name, members, group, job, device)
            if level is not None:
                _tell(say, describe_level(name, level.figures))
        dist.barrier()
    for members, group in ((node_ranks, node_group), (leaders, nodes_group)):
        if group is not None and rank in members:  # the others hold no group of it
            dist.destroy_process_group(group)
    if rank != 0:
        return None
    measured = levels["node"] or levels["nodes"]
    assert measured is not None
    rates, send = measured.rates, measured.send
    split = levels["node"].split if levels["node"] is not None else None
    alone = ("one GPU per worker: none computes beside another" if device.type == "cuda"
             else "one worker per node: none computes beside another")
    how = {
        "step_bandwidth": f"SGD step of {format_bytes(rates.nbytes)} of parameters, caches "
                          f"evicted before each, over the mean of {len(rates.step_s)}",
        "stash_copy_bandwidth": f"weight stashing's copy of the same, over the mean of "
                                f"{len(rates.copy_s)}",
        "corun_slowdown": alone if corun is None else
        f"{_CORUN_MODEL} forward+backward at batch {_CORUN_BATCH} on one thread, median "
        f"beside a busy twin over median alone ({len(corun.alone_s)} rounds each)",
        "send_overhead_s": _SEND_HOW, "send_copy_bandwidth": _SEND_HOW,
        "cores": "CPUs this process may run on",
        **({} if split is None else dict.fromkeys(_SPLIT_FIGURES, _split_how(job))),
        **typical_how(),
    }
    found = MachineFile(
        identity=here(), backend=job.backend,
        node=None if levels["node"] is None else levels["node"].figures,
        nodes=None if levels["nodes"] is None else levels["nodes"].figures,
        step_bandwidth=rates.step_bandwidth, stash_copy_bandwidth=rates.stash_copy_bandwidth,
        corun_slowdown=1.0 if corun is None else corun.slowdown,
        send_overhead_s=send.fixed_s, send_copy_bandwidth=send.bandwidth,
        cores=len(os.sched_getaffinity(0)),
        split_layer_forward_s=None if split is None else split.forward_s,
        split_layer_backward_s=None if split is None else split.backward_s,
        how=tuple(sorted(how.items())))
    _tell(say, describe(found)[-1])
    return found


def _level(name: str, members: list[int], group: Any, job: _Job, device: torch.device
           ) -> _Level | None:
    """One level's ping-pong (its first two members) and all-reduce (all of them), with the
    step and stash-copy rates; the figures on ``members[0]``."""
    probe, rank = job.probe, dist.get_rank()
    timer = timer_for(device)
    pong = None
    if rank in members[:2]:
        pong = ping_pong((members[0], members[1]), probe.sizes, budget_s=probe.budget_s,
                         min_time_s=probe.pingpong_s, device=device, timer=timer)
    guess = torch.tensor([0.0 if pong is None else pong.link.bandwidth], dtype=torch.float64,
                         device=device)
    dist.broadcast(guess, members[0], group=group)
    nbytes = int(min(probe.allreduce_max_bytes,
                     max(1 << 20, float(guess.item()) * probe.allreduce_target_s)))
    floats = nbytes // 4
    params = [torch.zeros(min(_FLOATS_PER_TENSOR, floats - start), device=device)
              for start in range(0, floats, _FLOATS_PER_TENSOR)]
    rates = measure_rates(params, rounds=probe.rounds, min_time_s=probe.min_time_s,
                          group=group, timer=timer)
    chains = (measure_split_chains(group, device, timer, probe.split_rounds)
              if name == "node" else None)  # a split stage lies inside one node
    if pong is None:
        return None
    pair = (f"2 of the node's {len(members)} workers" if name == "node" else
            f"workers on 2 of the {len(members)} nodes")
    sizes = ", ".join(format_bytes(s) for s in pong.sizes)
    how = (f"ping-pong between {pair} at {sizes}, fitted latency + bytes / bandwidth; the "
           f"runtime's bucketed all-reduce of {format_bytes(rates.nbytes)} among "
           f"{len(members)}, as a ring's bandwidth over the mean of "
           f"{len(rates.allreduce_s)} rounds; timed by {type(timer).__name__}")
    figures = LinkFigures(workers=len(members), backend=job.backend,
                          allreduce_bandwidth=rates.allreduce_bandwidth,
                          p2p_bandwidth=pong.link.bandwidth, latency_s=pong.link.fixed_s, how=how)
    split = None if chains is None else split_layer_cost(chains[0], chains[-1])
    return _Level(figures, rates, pong.send, split)


_SPLIT_FIGURES = ("split_layer_forward_s", "split_layer_backward_s")


def _split_how(job: _Job) -> str:
    return (f"chains of 2 and 8 Linear+ReLU layers (width 16) split out/in over the node's "
            f"workers, and plain, in turns, forward and backward timed apart, median of "
            f"{job.probe.split_rounds} rounds; per layer, the split chain's extra time")
