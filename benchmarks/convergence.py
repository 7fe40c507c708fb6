"""Time to accuracy: PipeDream's schedules against data parallelism, epoch by epoch.

Trains the examples' workloads (``examples/_workloads.py``) with
``dreampipe.Pipeline``, 3 seeds each, and records the held-out accuracy or
loss after every epoch with the training seconds so far. The study's two,
the digits CNN and the character-level transformer, run on 2 and 4 workers
under pipedream (with dreampipe's staleness compensation, the default, and
without it; no stashing and vertical sync, uncompensated as the paper ran
them), 2bw (with and without compensation), 1f1b-flush, gpipe and dp. The
wider groups run the defaults and their uncompensated forms beside
1f1b-flush and dp: the digits and the transformer with 8 blocks
(``chars8``) on 8 workers, and two workloads held out from the choice of
the compensation on 4: a plain deep MLP trained by SGD with momentum
(``mlp``) and a tiny Hugging Face GPT-2 with tied embeddings on another
corpus (``gpt2``). Each run is added to the results JSON as it ends; runs
already there are skipped, so an interrupted study resumes where it stopped.

    python benchmarks/convergence.py               # the study -> docs/convergence.json
    python benchmarks/convergence.py --report      # its table in docs/convergence.md, PNGs
    python benchmarks/convergence.py --quick --results /tmp/q.json --docs /tmp

``--quick`` is the CI-sized version: one seed, 2 workers, a few steps.
The runs of one seed in one group share one ``torchrun`` (one thread per
process), the first seed in every group first, so a study cut short still
covers every schedule.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.runtime.processes import free_port
from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["QUICK", "STUDY", "VARIANTS", "Group", "Study", "Variant", "Workload", "main"]

_ROOT = Path(__file__).resolve().parents[1]
_RESULTS = _ROOT / "docs" / "convergence.json"
_Batch = tuple[Tensor, Tensor]
#: Characters a window of the language workloads holds.
_CONTEXT = 64


class Workload(Enum):
    DIGITS = "digits"
    CHARS = "chars"
    #: The character transformer with 8 blocks, for 8 workers.
    CHARS8 = "chars8"
    MLP = "mlp"
    GPT2 = "gpt2"


@dataclass(frozen=True)
class Variant:
    """One way to train: a schedule, PipeDream's two options and staleness compensation."""

    name: str
    kind: ScheduleKind
    stash: bool = True
    vertical_sync: bool = False
    compensate: bool = True


VARIANTS = (
    Variant("pipedream", ScheduleKind.PIPEDREAM),
    Variant("pipedream-no-comp", ScheduleKind.PIPEDREAM, compensate=False),
    Variant("pipedream-no-stash", ScheduleKind.PIPEDREAM, stash=False, compensate=False),
    Variant("pipedream-vsync", ScheduleKind.PIPEDREAM, vertical_sync=True, compensate=False),
    Variant("2bw", ScheduleKind.TWO_BW),
    Variant("2bw-no-comp", ScheduleKind.TWO_BW, compensate=False),
    Variant("1f1b-flush", ScheduleKind.FLUSH),
    Variant("gpipe", ScheduleKind.GPIPE),
    Variant("dp", ScheduleKind.DP),
)
_BY_NAME = {v.name: v for v in VARIANTS}
#: The wider groups' variants: the defaults, uncompensated, beside the synchronous ones.
_WIDER = ("pipedream", "pipedream-no-comp", "2bw", "2bw-no-comp", "1f1b-flush", "dp")


@dataclass(frozen=True)
class Group:
    """Workloads trained on one count of workers under some variants, one ``torchrun``
    a seed."""

    workers: int
    workloads: tuple[str, ...]
    variants: tuple[str, ...]


@dataclass(frozen=True)
class Study:
    """What a results file holds: its header must match to add runs to it.

    ``epochs`` and ``steps`` are per workload; ``steps`` is the minibatches per
    epoch (None: a classifier's whole training set, 44 minibatches of 32 for the
    digits, 150 for the MLP); an epoch of a character model is ``steps``
    minibatches of fresh random windows (its corpus is too large to pass over).
    ``held_out_batches`` of ``batch`` windows score the character models; the
    transformers' corpus is about the standard library's first ``corpus_bytes``
    characters of source (GPT-2's is Python's documentation prose).
    """

    seeds: tuple[int, ...]
    groups: tuple[Group, ...]
    epochs: dict[str, int]
    steps: dict[str, int | None]
    held_out_batches: int = 16
    batch: int = 32
    corpus_bytes: int = 3_000_000

    def keys(self, group: Group, seed: int) -> list[str]:
        """The runs of one seed in ``group``: every schedule in turn, so they share the
        machine's load drift."""
        return [_key(Workload(w), v, group.workers, seed) for w in group.workloads
                for v in group.variants]

    def header(self) -> dict[str, Any]:
        """These settings as the results file's JSON holds them."""
        return json.loads(json.dumps(asdict(self)))  # type: ignore[no-any-return]


_PAIR = ("digits", "chars")
STUDY = Study(
    seeds=(0, 1, 2),
    groups=(Group(2, _PAIR, tuple(_BY_NAME)), Group(4, _PAIR, tuple(_BY_NAME)),
            Group(4, ("mlp", "gpt2"), _WIDER), Group(8, ("digits", "chars8"), _WIDER)),
    epochs={"digits": 10, "chars": 8, "chars8": 8, "mlp": 8, "gpt2": 6},
    steps={"digits": None, "chars": 30, "chars8": 30, "mlp": None, "gpt2": 40})
QUICK = Study(seeds=(0,), groups=(Group(2, tuple(w.value for w in Workload),
                                        ("pipedream", "2bw", "dp")),),
              epochs={w.value: 2 for w in Workload},
              steps={"digits": 4, "chars": 3, "chars8": 3, "mlp": 4, "gpt2": 3},
              held_out_batches=2, corpus_bytes=200_000)


def _key(workload: Workload, variant: str, workers: int, seed: int) -> str:
    return f"{workload.value}/{variant}/{workers}/{seed}"


# ---- the workloads ------------------------------------------------------------
def _workloads() -> ModuleType:
    """``examples/_workloads.py``, the examples' models and data."""
    sys.path.insert(0, str(_ROOT / "examples"))
    return importlib.import_module("_workloads")


@dataclass(frozen=True)
class _Task:
    """One workload for one seed: what the Pipeline takes and the epochs' batches."""

    model: nn.Module
    example: _Batch
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None
    max_grad_norm: float | None
    epoch: Callable[[], Iterable[_Batch]]
    held_out: list[_Batch] = field(repr=False)


def _classifier(study: Study, seed: int, train: Any, test: Any,
                build: Callable[[], nn.Module], steps: int | None) -> _Task:
    """A classifier (the digits' CNN, the MLP), SGD lr 0.05 with momentum 0.9, a seeded
    shuffle per epoch."""
    loader = torch.utils.data.DataLoader(
        train, batch_size=study.batch, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    return _Task(
        model=build(), example=(train.tensors[0][:study.batch], train.tensors[1][:study.batch]),
        loss_fn=F.cross_entropy, lr_scheduler=None, max_grad_norm=None,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        epoch=lambda: itertools.islice(loader, steps),
        held_out=list(torch.utils.data.DataLoader(test, batch_size=120)),
    )


@functools.cache
def _corpus(wl: ModuleType, max_bytes: int) -> Any:
    return wl.char_corpus(max_bytes)


def _chars(wl: ModuleType, study: Study, seed: int, workload: Workload) -> _Task:
    """The character transformer example's model (8 blocks for ``chars8``, else 4),
    AdamW with warm-up, clipping at 1."""
    corpus = _corpus(wl, study.corpus_bytes)
    blocks = 8 if workload is Workload.CHARS8 else 4
    return _language(wl, study, seed, corpus,
                     lambda: wl.gpt(corpus.vocab, context=_CONTEXT, layers=blocks),
                     study.steps[workload.value], warmup=20)


def _gpt2(wl: ModuleType, study: Study, seed: int) -> _Task:
    """A tiny Hugging Face GPT-2 with tied embeddings on Python's documentation prose,
    AdamW, clipping at 1, no warm-up."""
    corpus = wl.docs_corpus()
    return _language(wl, study, seed, corpus, lambda: wl.gpt2(corpus.vocab, context=_CONTEXT),
                     study.steps["gpt2"], warmup=0)


def _language(wl: ModuleType, study: Study, seed: int, corpus: Any,
              build: Callable[[], nn.Module], steps: int | None, warmup: int) -> _Task:
    """A character model on random windows of ``corpus``: AdamW 3e-3 clipped at 1, a
    linear warm-up of ``warmup`` updates (0: none)."""
    stream = wl.windows(corpus.train, study.batch, _CONTEXT, seed=1000 + seed)
    held = wl.windows(corpus.held_out, study.batch, _CONTEXT, seed=2)
    torch.manual_seed(seed)
    return _Task(
        model=build(), example=next(stream), loss_fn=wl.token_loss, max_grad_norm=1.0,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        lr_scheduler=None if not warmup else lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: min(1.0, (s + 1) / warmup)),
        epoch=lambda: itertools.islice(stream, steps),
        held_out=[next(held) for _ in range(study.held_out_batches)],
    )


def _task(wl: ModuleType, study: Study, workload: Workload, seed: int) -> _Task:
    if workload is Workload.DIGITS:
        return _classifier(study, seed, *wl.digits(), wl.cnn, study.steps["digits"])
    if workload is Workload.MLP:
        return _classifier(study, seed, *wl.blobs(), wl.mlp, study.steps["mlp"])
    if workload is Workload.GPT2:
        return _gpt2(wl, study, seed)
    return _chars(wl, study, seed, workload)


# ---- one run, on every rank -----------------------------------------------------
def _train(wl: ModuleType, study: Study, key: str) -> dict[str, Any]:
    """Train one run; its held-out figures after every epoch (epoch 0: the start)."""
    name, variant_name, workers, seed = key.split("/")
    workload, variant, world = Workload(name), _BY_NAME[variant_name], int(workers)
    task = _task(wl, study, workload, int(seed))
    layers = len(task.model)  # type: ignore[arg-type]
    plan = (dreampipe.Plan.from_config(layers, [0], [world]) if variant.kind is ScheduleKind.DP
            else wl.straight_plan(layers, world))
    pipelined = variant.kind in (ScheduleKind.FLUSH, ScheduleKind.GPIPE, ScheduleKind.TWO_BW)
    pipe = dreampipe.Pipeline(
        task.model, example=task.example, loss_fn=task.loss_fn, optimizer=task.optimizer,
        lr_scheduler=task.lr_scheduler, plan=plan, config=dreampipe.TrainConfig(
            schedule=variant.kind, microbatches=world if pipelined else 1,
            max_grad_norm=task.max_grad_norm, vertical_sync=variant.vertical_sync,
            stash=variant.stash, compensate=variant.compensate, timeout_s=600.0),
    )
    start = time.perf_counter()
    first = pipe.evaluate(task.held_out)
    run: dict[str, Any] = {"workload": workload.value, "variant": variant.name,
                           "workers": world, "seed": int(seed), "seconds": [0.0],
                           "train_loss": [None], "test_loss": [first.loss],
                           "test_accuracy": [first.accuracy]}
    for epoch in range(1, study.epochs[workload.value] + 1):
        t0 = time.perf_counter()
        for x, y in task.epoch():
            pipe.step(x, y)
        losses = pipe.finish()
        run["seconds"].append(run["seconds"][-1] + time.perf_counter() - t0)
        result = pipe.evaluate(task.held_out)
        run["train_loss"].append(sum(losses) / len(losses))
        run["test_loss"].append(result.loss)
        run["test_accuracy"].append(result.accuracy)
        if dist.get_rank() == 0:
            print(f"{key} epoch {epoch}: held-out loss {result.loss:.4f} accuracy "
                  f"{result.accuracy if result.accuracy is not None else '-'} "
                  f"after {run['seconds'][-1]:.1f} s", flush=True)
    pipe.close()
    run["wall_s"] = time.perf_counter() - start
    return run


def _worker(study: Study, results: Path, keys: list[str]) -> None:
    """One rank of a group: its runs in order; rank 0 adds each to the results file."""
    dist.init_process_group("gloo")
    wl = _workloads()
    for key in keys:
        run = _train(wl, study, key)
        if dist.get_rank() == 0:
            data = _load(results, study)
            data["runs"][key] = run
            _save(results, data)
        dist.barrier()
    dist.destroy_process_group()


# ---- the results file -------------------------------------------------------------
def _load(path: Path, study: Study) -> dict[str, Any]:
    """The results so far; a file written for other settings is an error, not mixed in."""
    if not path.exists():
        return {"study": study.header(), "runs": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("study") != study.header():
        raise SystemExit(f"{path} holds a study with other settings ({data.get('study')}); "
                         "pass another --results file or delete it")
    return data


def _save(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so an interrupted study never leaves a torn file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


# ---- the driver ---------------------------------------------------------------------
def _launch(study_name: str, results: Path, workers: int, keys: list[str],
            timeout_s: float) -> None:
    """``torchrun`` one group; its ranks' output passes through, a failure stops the study."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__,
           "--worker", study_name, "--results", str(results), "--keys", ",".join(keys)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {rc}")


def _run_study(study_name: str, study: Study, results: Path, timeout_s: float) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    _save(results, _load(results, study))
    for seed, group in itertools.product(study.seeds, study.groups):
        done = _load(results, study)["runs"]
        todo = [k for k in study.keys(group, seed) if k not in done]
        print(f"seed {seed} on {group.workers} workers ({', '.join(group.workloads)}): "
              f"{len(todo)} runs to do", flush=True)
        if todo:
            _launch(study_name, results, group.workers, todo, timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized study")
    parser.add_argument("--report", action="store_true",
                        help="write the table and plots from the results; train nothing")
    parser.add_argument("--results", type=Path, default=_RESULTS, help="the results JSON")
    parser.add_argument("--docs", type=Path, default=_ROOT / "docs",
                        help="where the report's convergence.md and PNGs go; with the "
                             "default, the report also writes the study's epochs to target "
                             "into src/dreampipe/runplan/study_epochs.py, which "
                             "--semantics any reads")
    parser.add_argument("--timeout", type=float, default=3 * 3600,
                        help="seconds one torchrun (one seed on one count of workers) may take")
    parser.add_argument("--worker", choices=("full", "quick"), help=argparse.SUPPRESS)
    parser.add_argument("--keys", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name = args.worker or ("quick" if args.quick else "full")
    study = QUICK if name == "quick" else STUDY
    if args.worker:
        _worker(study, args.results, args.keys.split(","))
        return
    if not args.report:
        start = time.perf_counter()
        _run_study(name, study, args.results, args.timeout)
        print(f"study done in {time.perf_counter() - start:.0f} s", flush=True)
    import convergence_report  # beside this script

    data = _load(args.results, study)
    for path in convergence_report.write(data, args.docs):
        print(f"wrote {path}")
    if args.docs.resolve() == (_ROOT / "docs").resolve():
        print(f"wrote {convergence_report.write_rows(data)}")


if __name__ == "__main__":
    main()
