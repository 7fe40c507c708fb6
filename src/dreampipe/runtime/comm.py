"""Point-to-point and all-reduce traffic of one rank, every wait with a deadline.

Activations go forward and gradients back with ``isend``/``irecv`` (gloo on
CPU, NCCL on GPU), each direction on a process group of its own. A link's
first activation is preceded by a header (ndim, dtype, shape), so that the
receiver can post its receives early; where shapes may vary (``varying``),
every activation is, its receive posted once its header is in. Messages are
tagged by the microbatch's number over the whole run. NCCL ignores tags, so
every receive is posted in the order its send is made; on gloo a stage also
posts the next minibatch's receives ahead. A rank runs one :class:`Comm` per
stage it holds; two stages of one rank hand microbatches over through their
``mailbox``. Peers are schedule ranks, mapped to workers by :mod:`.lanes`. A
wait past ``timeout_s`` raises :class:`~dreampipe.errors.PeerTimeoutError`
naming the rank, stage, peer, action and microbatch. The tags and the
ordering rules: docs/design.md §8.4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.errors import PeerTimeoutError, StageMismatchError
from dreampipe.planning.memory_terms import SENDS_KEPT
from dreampipe.runtime.lanes import Links
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["Comm"]

_ACT, _GRAD, _VER, _HDR = range(4)
_MAX_DIMS = 8
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_POLL_S = 100e-6
_TAG_MICROBATCHES = 2**28  # tags stay below 2**31, c10d's limit
_EVAL_TAGS = 2**30
_MAX_SENDS = SENDS_KEPT  # the planner counts their memory
_HINT = "check that rank's own error, or raise timeout_s (--timeout) if it is only slow"

Spec = tuple[tuple[int, ...], torch.dtype]
#: Actions whose peer is the next stage (the others' is the one before).
_UP = frozenset((ActionKind.SEND_F, ActionKind.RECV_B))


@dataclass
class _Recv:
    action: Action
    peer: int
    microbatch: int  # the run's number for the microbatch, which names its tags
    header: Tensor | None = None
    header_work: Any = None
    buf: Tensor | None = None
    work: Any = None
    version: Tensor | None = None
    version_work: Any = None


def _encode(spec: Spec, device: torch.device) -> Tensor:
    shape, dtype = spec
    if len(shape) > _MAX_DIMS or dtype not in _DTYPES:
        raise StageMismatchError(
            f"cannot send a {dtype} tensor of shape {shape} between stages; dreampipe sends "
            f"tensors of at most {_MAX_DIMS} dimensions and dtypes {[str(d) for d in _DTYPES]}"
        )
    head = [len(shape), _DTYPES.index(dtype), *shape, *([0] * (_MAX_DIMS - len(shape)))]
    return torch.tensor(head, dtype=torch.int64, device=device)


def _decode(header: Tensor) -> Spec:
    values = [int(v) for v in header.tolist()]
    return tuple(values[2 : 2 + values[0]]), _DTYPES[values[1]]


class Comm:
    """The sends and receives of rank ``rank`` (pipeline stage ``stage``)."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        device: torch.device,
        timeout_s: float,
        *,
        vertical_sync: bool = False,
        groups: tuple[Any, Any] | Links = (None, None),
        evaluation: bool = False,
        stage: int | None = None,
        mailbox: dict[tuple[int, int, int], Tensor] | None = None,
        varying: bool = False,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.stage = schedule.stage_of_rank(rank) if stage is None else stage
        #: Tensors handed to another stage of this rank, by (kind, sending stage, run's microbatch).
        self.mailbox: dict[tuple[int, int, int], Tensor] = {} if mailbox is None else mailbox
        self.device = device
        self.timeout_s = timeout_s
        self.vertical_sync = vertical_sync
        self._blocking = dist.get_backend() == "gloo"
        self._evaluation = evaluation
        #: Whether microbatches may change shape: every activation then carries a header.
        self.varying = varying
        #: The run's number for the schedule's microbatch 0 (a Pipeline's later segments).
        self.first_microbatch = 0
        self._fwd, self._bwd = groups[0], groups[1]
        self._routes = groups.routes if isinstance(groups, Links) else None
        self._work_name = "minibatch" if schedule.kind is ScheduleKind.PIPEDREAM else "microbatch"
        self._in_spec: Spec | None = None
        self._in_links: set[int] = set()
        self._out_spec: Spec | None = None
        self._out_links: set[int] = set()
        self._sent: dict[int, Spec] = {}
        self._recvs: dict[tuple[ActionKind, int], _Recv] = {}
        self._set_aside: list[_Recv] = []
        self._sends: list[tuple[Any, Action, int, Tensor]] = []

    # ---- waiting ---------------------------------------------------------
    def _in_run(self, action: Action) -> str:
        """``action`` numbered as the run counts its microbatches (a Pipeline's later
        segments, after a checkpoint, go on counting), with the work it is on."""
        shift = self.first_microbatch
        shown = replace(action, microbatch=action.microbatch + shift,
                        backward_microbatch=action.backward_microbatch + shift
                        if action.backward_microbatch >= 0 else -1)
        return f"{shown} ({self._work_name} {shown.microbatch})"

    def _describe(self, action: Action, peer: str) -> str:
        return (
            f"rank {self.rank} (stage {self.stage}) waited more than {self.timeout_s:g} s for "
            f"{peer} in {self._in_run(action)}"
        )

    def _wait(self, work: Any, action: Action, peer: str) -> None:
        start = time.monotonic()
        try:
            if self._blocking:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
                return
            while not work.is_completed():
                if time.monotonic() - start > self.timeout_s:
                    raise PeerTimeoutError(f"{self._describe(action, peer)}; {_HINT}")
                time.sleep(_POLL_S)
            work.wait()
        except RuntimeError as exc:
            waited = time.monotonic() - start
            reason = str(exc).strip().split("\n", 1)[0] or type(exc).__name__
            if waited < self.timeout_s:
                raise PeerTimeoutError(
                    f"rank {self.rank} (stage {self.stage}) lost {peer} in "
                    f"{self._in_run(action)} after {waited:.1f} s ({reason}); "
                    "that rank failed or exited first: see its own error"
                ) from exc
            raise PeerTimeoutError(f"{self._describe(action, peer)} ({reason}); {_HINT}") from exc

    # ---- receives --------------------------------------------------------
    @property
    def posts_ahead(self) -> bool:
        """Whether receives may be posted for microbatches the run may not reach: on gloo, whose
        tags match them; not on NCCL, which matches in order (docs/design.md §8.4)."""
        return self._blocking

    @property
    def pending_receives(self) -> frozenset[tuple[ActionKind, int]]:
        """The receives posted and not yet taken: (kind, the run's number for the microbatch)."""
        return frozenset(self._recvs)

    def _key(self, action: Action) -> tuple[ActionKind, int]:
        return action.kind, self.first_microbatch + action.microbatch

    def _tag(self, microbatch: int, kind: int, action: Action) -> int:
        """The tag of the run's microbatch ``microbatch`` on ``action``'s link
        (docs/design.md §8.4)."""
        v = self.schedule.virtual_stages
        if v > 1:  # links between the same two workers, one per chunk: (microbatch, chunk)
            link = min(action.stage, action.stage + (1 if action.kind in _UP else -1))
            microbatch = microbatch * v + link // (self.schedule.num_stages // v)
        return _EVAL_TAGS * self._evaluation + 4 * (microbatch % _TAG_MICROBATCHES) + kind

    def post(self, action: Action) -> bool:
        """Post the receive for ``action`` now; False if it cannot be posted yet."""
        key = self._key(action)
        peer = self.schedule.peer(self.rank, action)
        assert peer is not None
        if peer == self.rank:
            return True  # a hand-off within the rank: nothing to post
        posted = self._recvs.get(key)
        if posted is not None:
            if posted.peer == peer:
                return True
            self._set_aside.append(self._recvs.pop(key))
        r = _Recv(action, peer, key[1])
        if action.kind is ActionKind.RECV_F:
            known = peer in self._in_links and not self.varying
            if not known:
                # a header's receive waits for the one before it on the link, unless every
                # message has one and tags match them (gloo)
                if not (self.varying and self._blocking) and any(
                        x.peer == peer and x.header is not None for x in self._recvs.values()):
                    return False
                r.header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                r.header_work = dist.irecv(
                    r.header, group_src=self._source(peer), tag=self._tag(r.microbatch, _HDR,
                                                                          action),
                    group=self._fwd,
                )
            if self.vertical_sync:
                r.version = torch.empty(1, dtype=torch.int64, device=self.device)
                r.version_work = dist.irecv(
                    r.version, group_src=self._source(peer), tag=self._tag(r.microbatch, _VER,
                                                                           action),
                    group=self._fwd,
                )
            if known:  # after the version, as it was sent (see "Order" above)
                assert self._in_spec is not None
                self._post_data(r, self._in_spec, _ACT)
        else:
            spec = self._sent.get(key[1])
            if spec is None:
                return False
            self._post_data(r, spec, _GRAD)
        self._recvs[key] = r
        return True

    def set_aside_unclaimed(self) -> None:
        """At a new segment's start (schedule and :attr:`first_microbatch` set): set aside the
        receives posted ahead that the new schedule does not make from the same peer, such as
        a microbatch round-robin now gives another replica; one left posted would hold back its
        link's next header for ever (docs/design.md §8.4)."""
        wanted = {self._key(a): self.schedule.peer(self.rank, a)
                  for a in self.schedule.actions[self.rank]
                  if a.stage == self.stage and a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)}
        for key in [k for k, r in self._recvs.items() if wanted.get(k) != r.peer]:
            self._set_aside.append(self._recvs.pop(key))

    def _post_data(self, r: _Recv, spec: Spec, kind: int) -> None:
        r.buf = torch.empty(spec[0], dtype=spec[1], device=self.device)
        group = self._fwd if kind == _ACT else self._bwd
        r.work = dist.irecv(r.buf, group_src=self._source(r.peer),
                            tag=self._tag(r.microbatch, kind, r.action), group=group)

    def take(self, action: Action) -> tuple[Tensor, int | None]:
        """Wait for ``action``'s tensor (and, with vertical sync, its weight version)."""
        if self.schedule.peer(self.rank, action) == self.rank:
            return self.mailbox.pop(self._handoff(action)), None
        if not self.post(action):
            raise RuntimeError(f"rank {self.rank} cannot receive {action} before sending its input")
        r = self._recvs.pop(self._key(action))
        peer = f"rank {r.peer} (stage {self.schedule.stage_of_rank(r.peer)})"
        if r.header is not None:
            self._wait(r.header_work, action, peer)
            spec = _decode(r.header)
            self._agree_input(spec, r.peer)
            self._post_data(r, spec, _ACT)
        version = None
        if r.version is not None:
            self._wait(r.version_work, action, peer)
            version = int(r.version.item())
        self._wait(r.work, action, peer)
        assert r.buf is not None
        return r.buf, version

    def _agree_input(self, spec: Spec, peer: int) -> None:
        if self._in_spec is not None and spec != self._in_spec and not self.varying:
            raise StageMismatchError(
                f"stage {self.stage} (rank {self.rank}) expects "
                f"{self._describe_spec(self._in_spec)} from stage {self.stage - 1} but rank "
                f"{peer} (stage {self.stage - 1}) sends "
                f"{self._describe_spec(spec)}; every replica must produce the same shape"
            )
        self._in_spec = spec
        self._in_links.add(peer)

    @staticmethod
    def _describe_spec(spec: Spec) -> str:
        return f"{spec[1]} tensors of shape {list(spec[0])}"

    # ---- sends -----------------------------------------------------------
    def send(self, action: Action, tensor: Tensor, version: int | None = None) -> None:
        """Post the send for ``action`` (SEND_F or SEND_B); it completes in the background."""
        peer = self.schedule.peer(self.rank, action)
        assert peer is not None
        microbatch = self.first_microbatch + action.microbatch
        data = tensor.detach()
        if peer == self.rank:
            self.mailbox[self._handoff(action)] = data
            return
        if not data.is_contiguous():
            data = data.contiguous()
        if action.kind is ActionKind.SEND_F:
            spec: Spec = (tuple(data.shape), data.dtype)
            if self._out_spec is None or self.varying:
                self._out_spec = spec
            elif spec != self._out_spec:
                raise StageMismatchError(
                    f"stage {self.stage} (rank {self.rank}) produced "
                    f"{self._describe_spec(spec)} for {self._work_name} {action.microbatch} "
                    "but agreed "
                    f"on {self._describe_spec(self._out_spec)} with stage {self.stage + 1}; "
                    "every microbatch must have the same shape, or say which may change: "
                    "a traced model may pass on more or fewer values for some inputs (a "
                    "Hugging Face model drops an attention mask that is all ones), so give "
                    "TrainConfig(variable_dims=(1,)) (any dimension) and every message "
                    "carries its shapes"
                )
            if peer not in self._out_links or self.varying:
                self._isend(_encode(spec, self.device), peer, microbatch, _HDR, action)
                self._out_links.add(peer)
            if self.vertical_sync:
                assert version is not None
                self._isend(torch.tensor([version], dtype=torch.int64, device=self.device),
                            peer, microbatch, _VER, action)
            self._sent[microbatch] = spec
        self._isend(data, peer, microbatch, _ACT if action.kind is ActionKind.SEND_F else _GRAD,
                    action)
        if len(self._sends) > _MAX_SENDS:
            self._settle(_MAX_SENDS // 2)

    def _isend(self, data: Tensor, peer: int, microbatch: int, kind: int, action: Action) -> None:
        """Send ``data`` to schedule rank ``peer``'s workers this worker feeds (its routes):
        on the gradient group for a gradient, else on the activation group."""
        group = self._bwd if kind == _GRAD else self._fwd
        for dst in (peer,) if self._routes is None else self._routes.targets(peer):
            work = dist.isend(data, group_dst=dst, tag=self._tag(microbatch, kind, action),
                              group=group)
            self._sends.append((work, action, peer, data))

    def _source(self, peer: int) -> int:
        """The group rank that schedule rank ``peer``'s tensors come from to this worker."""
        return peer if self._routes is None else self._routes.source(peer)

    def _handoff(self, action: Action) -> tuple[int, int, int]:
        """The mailbox key of a send or receive within the rank."""
        key = action.transfer_key
        assert key is not None
        return key[0], key[1], self.first_microbatch + key[2]

    def forget(self, microbatch: int) -> None:
        """Drop bookkeeping for ``microbatch`` once its gradient has arrived."""
        self._sent.pop(self.first_microbatch + microbatch, None)

    def drain(self) -> None:
        """Wait for every posted send to complete."""
        self._settle(0)

    def _settle(self, keep: int) -> None:
        """Wait for the oldest sends (long done, normally) until ``keep`` remain."""
        done = len(self._sends) - keep
        for work, action, peer, _ in self._sends[:done]:
            self._wait(work, action, f"rank {peer} (stage {self.schedule.stage_of_rank(peer)})")
        del self._sends[:done]

    # ---- all-reduce ------------------------------------------------------
    def wait_allreduce(self, work: Any, action: Action) -> None:
        """Wait for an all-reduce over this stage's replicas (a bucket of ``action``'s round)."""
        replicas = self.schedule.replicas[self.stage]
        first = self.schedule.first_rank(self.stage)
        self._wait(work, action, f"ranks {first}..{first + replicas - 1} (all-reduce)")

    def wait_world(self, work: Any, action: Action) -> None:
        """Wait for an all-reduce over every rank at ``action`` (the global gradient norm,
        or whether to skip a non-finite update)."""
        self._wait(work, action, "every rank (all-reduce over the world)")

    def wait_tied(self, work: Any, action: Action) -> None:
        """Wait for the all-reduce of a tied weight's gradients at ``action``, over the
        stages that hold a copy of it."""
        self._wait(work, action, "the stages sharing a tied weight (all-reduce)")
