"""dreampipe's one process supervisor: a function on a rank per local process.

:func:`run_processes` starts one process per rank on this machine (forked
from a server that has imported torch once, else spawned; torchrun's
environment on 127.0.0.1 and a free port, :func:`prepare_process`'s set-up)
and supervises them::

    parent ── start ranks ── wait for results / failures / exits
                                │ a rank fails ──▶ grace 1 s for
                                │ the others' reports, terminate
                                ▼ the rest, raise with tracebacks
                              results by rank

No process outlives the call: children are terminated on any failure, on the
optional overall deadline, and exit by themselves if the parent dies.
dreampipe's local ranks and the bench's PyTorch baselines all start here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from dreampipe.errors import TRACEBACK_HEADER, DreampipeError, PeerTimeoutError, WorkerError
from dreampipe.profiling.heap import glibc
from dreampipe.runtime.ports import free_port

__all__ = [
    "HeapPolicy",
    "RankFn",
    "free_port",
    "pinned_threads",
    "prepare_process",
    "run_processes",
]

_log = logging.getLogger(__name__)
_GRACE_S = 1.0
#: What gloo and NCCL say when a peer process is gone: a failure that follows another's.
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|connectFullMesh failed|Broken pipe"
                        r"|remote process exited")
#: What the forkserver imports once for every rank it forks: a rank's first optimizer
#: imports ``torch._dynamo`` and DTensor (over a second), which a forked rank inherits.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
            "torch.distributed.checkpoint", "dreampipe.runtime", "dreampipe.api"]
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


#: What each rank of :func:`run_processes` runs: ``fn(rank, world, arg)``.
RankFn = Callable[[int, int, Any], Any]


@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block, restored after.

    A CPU worker runs on one thread, so profiles and costs meant for workers
    are measured that way too.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HeapPolicy(Enum):
    """What a worker's glibc heap does with freed memory."""

    #: dreampipe's set-up: keep freed tensor memory in the heap for the next microbatch.
    KEEP_FREED = "keep-freed"
    #: glibc's defaults, and every object in the garbage collector's reach, as a
    #: plain PyTorch process has them.
    STOCK = "stock"


#: mallopt's settings per policy: (mmap threshold, trim threshold, top pad).
_HEAP_SETTINGS = {
    HeapPolicy.KEEP_FREED: (32 * 2**20, 2**30, 64 * 2**20),
}


def prepare_process(threads: int | None = None, heap: HeapPolicy = HeapPolicy.KEEP_FREED) -> None:
    """The set-up of every worker process: ``threads`` intra-op threads (None: as is), and the heap.

    Every process :func:`run_processes` starts gets it, dreampipe's ranks and
    the bench's PyTorch baselines alike, and so does a torchrun rank.
    ``KEEP_FREED`` lets glibc reuse freed tensor memory instead of returning
    it to the kernel: each backward allocates fresh multi-MB gradients and
    activations; with glibc's defaults they are ``mmap``-ed and ``munmap``-ed
    every time and every page faults again on first touch, which costs a CPU
    worker about a fifth of its backward time. Raising the mmap and trim
    thresholds keeps the memory in the heap for the next microbatch (the tuning
    "use a caching allocator" advice gets you with jemalloc or tcmalloc).
    It touches host memory only, so GPU workers are unaffected.

    Unless ``STOCK``, it also freezes the objects alive so far (``gc.freeze``:
    torch's and dreampipe's modules, classes and functions, about 250,000)
    out of the garbage collector's reach. They live as long as the process,
    and a full collection would walk them all, a pause of a hundred
    milliseconds or more whenever enough objects have been allocated (such as
    by building a long schedule), many times what the collection takes without them.
    Frozen objects are never collected, so garbage that is alive then (a
    torchrun rank's own start-up) stays for the life of the process.
    """
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if heap is not HeapPolicy.STOCK:
        gc.freeze()
    settings = _HEAP_SETTINGS.get(heap)
    libc = glibc() if settings is not None else None
    if settings is None or libc is None:
        return
    try:
        for option, value in zip((_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _M_TOP_PAD), settings,
                                 strict=True):
            libc.mallopt(option, value)
    except AttributeError as exc:
        _log.debug("cannot tune the allocator: %s", exc)


def run_processes(
    fn: RankFn,
    world: int,
    arg: Any,
    *,
    threads: int | None = 1,
    deadline_s: float | None = None,
    where: Callable[[int], str] | None = None,
    error: type[DreampipeError] | None = None,
    heap: HeapPolicy = HeapPolicy.KEEP_FREED,
) -> list[Any]:
    """``fn(rank, world, arg)`` on ``world`` fresh processes; their results by rank.

    Each process has torchrun's environment (``MASTER_ADDR``/``PORT`` on a
    free local port, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and
    :func:`prepare_process`'s set-up with ``threads`` threads (None: torch's
    default) and ``heap``. A rank's exception, a rank
    dying or ``deadline_s`` passing stops every rank and raises ``error``
    with each failed rank's traceback; ``error`` None raises the first
    rank's own class when it is a DreampipeError, else
    :class:`~dreampipe.errors.WorkerError`. ``where(rank)`` names a rank's
    part in the message (e.g. its stage).
    """
    for _ in range(_PORT_TRIES - 1):
        try:
            return _launch(fn, world, arg, (threads, heap), deadline_s, where, error)
        except DreampipeError as exc:  # rank 0 could not listen: the port went meanwhile
            if "EADDRINUSE" not in str(exc):
                raise
            _log.warning("the rendezvous port was taken before rank 0 listened on it; "
                         "starting the %d ranks again on another", world)
    return _launch(fn, world, arg, (threads, heap), deadline_s, where, error)


#: Launches :func:`run_processes` tries when another process takes its port first.
_PORT_TRIES = 3


def _launch(fn: RankFn, world: int, arg: Any, setup: tuple[int | None, HeapPolicy],
            deadline_s: float | None, where: Callable[[int], str] | None,
            error: type[DreampipeError] | None) -> list[Any]:
    """One launch of :func:`run_processes` on a fresh :func:`free_port`."""
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, arg, rank, world, port, setup, send, os.getpid(), _Inherited()),
                name=f"dreampipe-rank{rank}", daemon=True,
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _supervise(procs, conns, deadline_s, where, error)
    finally:
        _end(procs, force=True)
        for c in conns:
            c.close()


def _end(procs: list[Any], *, force: bool) -> None:
    """Join every rank; with ``force`` first terminate the live ones (continuing a stopped
    one, which would otherwise end only when continued) and kill any still alive after 5 s."""
    if force:
        for p in procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
    for p in procs:
        p.join(5.0)
        if force and p.is_alive():
            p.kill()
            p.join()


def _context() -> Any:
    """Where ranks come from: forkserver with torch imported once, else spawn.

    A spawned rank imports torch again (seconds on a small CPU machine); a
    rank forked from the server starts at once. The server imports only
    (no thread pool, no CUDA context yet), so forking it is safe.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Inherited:
    """What a spawned rank inherits from its launcher, for a forked one too.

    A rank forked by the forkserver starts with the server's environment,
    stdout and stderr as they were when the server started; pickled into
    the child, this carries the launcher's as they are now (the file
    descriptors travel as the start method passes them).
    """

    def __init__(self, environ: dict[str, str] | None = None,
                 fds: tuple[int, int] | None = None) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received, (self.environ, reduction.DupFd(1), reduction.DupFd(2)))

    def apply(self) -> None:
        """In the child: take the environment, write to the launcher's stdout and stderr."""
        os.environ.clear()
        os.environ.update(self.environ)
        if self.fds is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, target in zip(self.fds, (1, 2), strict=True):
                os.dup2(fd, target)
                os.close(fd)


def _received(environ: dict[str, str], out: Any, err: Any) -> _Inherited:
    return _Inherited(environ, (out.detach(), err.detach()))


def _watch_parent(parent: int) -> None:
    """Exit when ``parent`` (the supervisor, not the forkserver) is gone."""

    def loop() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=loop, daemon=True).start()


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    """Plain pickle: tensors travel by value, not as shared memory the exiting child owns."""
    conn.send_bytes(pickle.dumps(msg))


def _child(
    fn: RankFn, arg: Any, rank: int, world: int, port: int,
    setup: tuple[int | None, HeapPolicy], conn: Connection, parent: int, inherited: _Inherited,
) -> None:
    """One local rank: the parent's and torchrun's environment, then ``fn``; its result or
    error to the parent."""
    _watch_parent(parent)
    inherited.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    code = 0
    try:
        prepare_process(*setup)
        _send(conn, ("ok", rank, fn(rank, world, arg)))
    except BaseException as exc:
        code = 1
        kind = type(exc) if isinstance(exc, DreampipeError) else None
        _send(conn, ("err", rank, kind, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _supervise(
    procs: list[Any],
    conns: list[Connection],
    deadline_s: float | None,
    where: Callable[[int], str] | None,
    error: type[DreampipeError] | None,
) -> list[Any]:
    start = time.monotonic()
    deadline = None if deadline_s is None else start + deadline_s
    results: dict[int, Any] = {}
    failures: dict[int, tuple[Any, str, str]] = {}
    open_conns = dict(enumerate(conns))
    grace_until: float | None = None
    while open_conns:
        now = time.monotonic()
        limits = [t for t in (deadline, grace_until) if t is not None]
        if limits and now >= min(limits):
            break
        timeout = min(limits) - now if limits else None
        ready = wait(list(open_conns.values()), timeout)
        for obj in ready:
            rank = next(r for r, c in open_conns.items() if c is obj)
            conn = open_conns[rank]
            del open_conns[rank]
            try:
                msg: tuple[Any, ...] = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(1.0)
                failures[rank] = (
                    None, f"exited with code {procs[rank].exitcode} without a result", ""
                )
            else:
                if msg[0] == "ok":
                    results[rank] = msg[2]
                else:
                    failures[rank] = (msg[2], msg[3], msg[4])
            if rank in failures and grace_until is None:
                grace_until = time.monotonic() + _GRACE_S
    _end(procs, force=bool(failures or open_conns))
    if failures:
        raise _failure(procs, failures, sorted(open_conns), where, error)
    if open_conns:
        raise (error or WorkerError)(
            f"the run passed its deadline of {deadline_s:g} s; ranks {sorted(open_conns)} "
            "were still running and have been terminated"
        )
    return [results.get(rank) for rank in range(len(procs))]


def _failure(
    procs: list[Any],
    failures: dict[int, tuple[Any, str, str]],
    running: list[int],
    where: Callable[[int], str] | None,
    error: type[DreampipeError] | None,
) -> Exception:
    def who(rank: int) -> str:
        return f"rank {rank} ({where(rank)})" if where is not None else f"rank {rank}"

    def follows(rank: int) -> bool:
        """A peer timeout (or lost peer) is what a failing rank leaves its peers with:
        dreampipe's, or the transport's own (a rank that exits while the group forms)."""
        kind, message, _ = failures[rank]
        return (isinstance(kind, type) and issubclass(kind, PeerTimeoutError)) or (
            kind is None and _LOST_PEER.search(message) is not None)

    order = sorted(failures, key=lambda r: (follows(r), r))
    first = order[0]
    kind, message, _ = failures[first]
    codes = {rank: p.exitcode for rank, p in enumerate(procs)}
    lines = [f"{who(first)} failed: {message}"]
    lines += [f"{who(r)} also failed: {failures[r][1]}" for r in order[1:]]
    lines += [f"{who(r)} had not finished (busy, hung or stopped) and was ended" for r in running]
    lines.append(f"exit codes by rank: {codes}")
    for r in order:
        if failures[r][2]:
            lines.append(f"{TRACEBACK_HEADER} {r} ---\n{failures[r][2].rstrip()}")
    text = "\n".join(lines)
    if error is not None:
        return error(text)
    if isinstance(kind, type) and issubclass(kind, DreampipeError):
        try:
            return kind(text)
        except TypeError:
            pass
    return WorkerError(text)
