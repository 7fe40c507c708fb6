"""Staleness compensation candidates, measured on a single-process model of delayed updates.

Each stage of the convergence study's cuts (``examples/_workloads.py``'s
straight plans; a weight two stages share, GPT-2's tied embedding and head,
is a copy on each that runs on that stage's version, takes the sum of both
gradients and the same update) trains with its own optimizer; minibatch ``t`` runs, forward
and backward, on each stage's weights after ``max(e, t - d_s)`` of its
updates, and its gradient updates the newest ones: PipeDream's weight
stashing with delays ``d_s = n - 1 - s`` (``pipedream``), or one on every
stage (``2bw``), or none (``sync``, dp's updates; ``pipedream-settings``:
with each stage's settings as a candidate sets them for pipedream). ``e`` is the updates made
before the epoch: the study's runs drain the pipeline at every epoch's end,
so an epoch's first minibatches run on its first weights, as in the runtime
(whose 2bw and pipedream runs this model reproduces to the printed digits).
The candidates of issue 32:

- ``none``: the user's settings as given;
- ``default``: dreampipe's rule, what the runtime does by default
  (:mod:`dreampipe.runtime.staleness`): SGD's momentum reduced by the delay's
  implicit momentum ``d / (d + 1)`` (Mitliagkas et al. 2016); an Adam stage
  keeps its settings and runs on its weights extrapolated to the update its
  gradient goes into,
  ``w_v + k (w_v - w_{v-1})``, ``k = t - v``, for versions made in the epoch's
  segment (:mod:`dreampipe.runtime.versions`);
- ``predict-settings``: that prediction on every delayed stage, with the
  settings of ``default`` (what dreampipe's rule was while it predicted for
  SGD too);
- ``momentum``: the rule dreampipe applied before weight prediction: momentum
  (``beta1`` for AdamW too) reduced by ``d / (d + 1)``, AdamW's learning rate
  scaled to keep the spread of its step, ``s(beta1) / s(beta1')`` with
  ``s(b) = sqrt((1 - b) / (1 + b))``; the candidates below that say "the rule"
  build on it;
- ``momentum-only``: the same momentum, every learning rate as given;
- ``momentum-lr``: dreampipe's rule, then the learning rate divided by ``d + 1``;
- ``damping``: ``1 - momentum`` multiplied by ``d + 1``;
- ``zero``: no momentum on a delayed stage;
- ``lr``: the learning rate divided by ``d + 1``;
- ``dc-asgd``: the gradient corrected by ``lambda g*g*(w_now - w_stale)``
  (Zheng et al. 2017, lambda 0.04);
- ``warmup``: the first epoch's updates synchronous (no delay);
- ``predict``: weight prediction (the model only; the runtime does not do it):
  a delayed stage runs forward and backward on its stale weights extrapolated
  by their last update, ``w_v + k (w_v - w_{v-1})`` with ``k`` the updates it
  lags behind;
- ``predict-momentum``: ``predict`` on top of dreampipe's rule;
- ``adam-predict``: a delayed stage runs forward and backward on its stale
  weights moved ``k`` times by the step its own optimizer would take next from
  its state at that version (XPipe, Guan et al. 2019; PipeMare): AdamW's
  ``lr (m_hat / (sqrt(v_hat) + eps) + weight_decay w_v)``, SGD's
  ``lr * momentum_buffer``; ``adam-predict-momentum``: the same on top of
  dreampipe's rule;
- ``dc-asgd-a0.5``, ``dc-asgd-a1``, ``dc-asgd-a2``: DC-ASGD's adaptive variant,
  ``g + lambda0 g*g / sqrt(v + eps) (w_now - w_stale)``, ``v`` the optimizer's
  running mean of ``g*g`` (Adam's ``exp_avg_sq`` with this gradient, bias
  corrected; for SGD a mean of its own, decay 0.95), ``lambda0`` 0.5, 1, 2;
- ``warmup-momentum``: ``warmup``, then dreampipe's rule from the first
  delayed update on; ``warmup-predict-momentum``: the same with ``predict``.

The candidates of issue 43, each with the user's learning rate:

- ``nesterov``: PipeNAG (Ajanthan et al. 2025, arXiv 2505.01099; its code):
  the optimizer's Nesterov form, AdamW as NAdam with decoupled weight decay,
  SGD with ``nesterov=True``, every stage, and the momentum of a stage of
  delay ``d`` raised toward 0.99 by ``d / n`` of the way (``n`` stages);
- ``error-feedback``: an error-feedback step in the spirit of Zmushko et al.
  2026 (arXiv 2606.30634; its exact rule was not at hand): the update a stale
  gradient gives misses about ``d`` times the change of the stage's step, so
  ``d (s_t - s_{t-1})`` is added to the step ``s_t`` the optimizer took;
- ``paci``: PACI's local accumulation (arXiv 2606.07881): a stage of delay
  ``d`` updates once every ``d + 1`` minibatches with their mean gradient, so
  a microbatch's weights are at most one update old; ``paci-default``: the
  same with dreampipe's rule;
- ``default-tied``: dreampipe's rule, and each copy of a tied weight runs on
  the weights its first stage runs the minibatch on (one version per tie);
- ``pipemare``: PipeMare (Yang et al. 2021): the learning rate of a stage of
  delay ``d`` divided by ``d ** (1 - t / K)`` over the first epoch's ``K``
  minibatches, and its weights predicted ``k`` updates ahead along an
  exponential average of its updates (decay ``0.1 ** (1 / d)``).
- ``default-ahead``: dreampipe's rule with its prediction one update further,
  ``w_v + (k + 1) (w_v - w_{v-1})`` on a delayed stage: the gradient then goes
  into the update it was taken one step beyond, a Nesterov-style look-ahead on
  top of the delay's.
- ``paci-ahead``: ``paci-default`` with that look-ahead.

The workloads, data, optimizers and epochs are :mod:`staleness_tasks`'s (the
study's two, and the held-out ``mlp`` and ``gpt2``), seed by seed; prints one
line per run and a JSON line of every figure (``staleness_sweep.py`` runs the
grid and tells epochs to target)::

    python benchmarks/staleness.py --workload digits --seeds 0 1 2
    python benchmarks/staleness.py --workload chars --workers 2 --seeds 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from dreampipe.runtime.staleness import Hyper, compensated, hyper_of, predicts

__all__ = ["CANDIDATES", "main", "simulate"]

sys.path.insert(0, str(Path(__file__).resolve().parent))
import staleness_tasks as tasks
import staleness_updates as updates


@dataclass(frozen=True)
class _Recipe:
    """A candidate: the :func:`_settings` rule, the weights a delayed stage runs on
    (``predict``: "" its stale ones, "last" extrapolated by their last update,
    "every" the same as the runtime does it, "segment" so where dreampipe's rule
    predicts, "optimizer" moved by its optimizer's next step, "ema" by an exponential
    average of its updates, PipeMare's), DC-ASGD's ``lambda`` (0: off;
    ``adaptive``: divided by the root mean square of the gradient), whether the
    first epoch is synchronous (the rule's settings from the first delayed update on),
    ``nesterov`` (PipeNAG's optimizer), ``feedback`` (the error-feedback step),
    ``accumulate`` (PACI's window), ``anneal`` (PipeMare's learning rate),
    ``tied_owner`` (a tied weight's copies run on its first stage's version) and
    ``ahead`` (updates a prediction looks beyond the delay)."""

    settings: str = "none"
    predict: str = ""
    dc: float = 0.0
    adaptive: bool = False
    warmup: bool = False
    nesterov: bool = False
    feedback: bool = False
    accumulate: bool = False
    anneal: bool = False
    tied_owner: bool = False
    ahead: int = 0


_RECIPES = {
    "default": _Recipe("dreampipe", predict="segment"),
    "predict-settings": _Recipe("dreampipe", predict="every"),
    **{rule: _Recipe(rule) for rule in ("none", "momentum", "momentum-only", "momentum-lr",
                                        "damping", "zero", "lr")},
    "dc-asgd": _Recipe(dc=0.04),
    "warmup": _Recipe(warmup=True),
    "predict": _Recipe(predict="last"),
    "predict-momentum": _Recipe("momentum", predict="last"),
    "adam-predict": _Recipe(predict="optimizer"),
    "adam-predict-momentum": _Recipe("momentum", predict="optimizer"),
    **{f"dc-asgd-a{lam:g}": _Recipe(dc=lam, adaptive=True) for lam in (0.5, 1.0, 2.0)},
    "warmup-momentum": _Recipe("momentum", warmup=True),
    "warmup-predict-momentum": _Recipe("momentum", predict="last", warmup=True),
    "nesterov": _Recipe(nesterov=True),
    "nesterov-default": _Recipe("dreampipe", predict="segment", nesterov=True),
    "error-feedback": _Recipe(feedback=True),
    "paci": _Recipe(accumulate=True),
    "pipemare": _Recipe(predict="ema", anneal=True),
    "paci-default": _Recipe("dreampipe", predict="segment", accumulate=True),
    "default-tied": _Recipe("dreampipe", predict="segment", tied_owner=True),
    "default-ahead": _Recipe("dreampipe", predict="segment", ahead=1),
    "paci-ahead": _Recipe("dreampipe", predict="segment", accumulate=True, ahead=1),
}
CANDIDATES = tuple(_RECIPES)
_SGD_MEAN_SQUARE_DECAY = 0.95
_PIPEMARE_D = 0.1  # PipeMare's discrepancy decay: gamma = D ** (1 / d)


def _cuts(layers: int, stages: int) -> list[int]:
    return [*(round(i * layers / stages) for i in range(stages)), layers]


def _delays(schedule: str, stages: int) -> list[int]:
    if schedule.startswith("pipedream"):
        return [stages - 1 - s for s in range(stages)]
    return [1 if schedule == "2bw" else 0] * stages


def _settings(opt: torch.optim.Optimizer, candidate: str, delay: int,
              sched: Any = None) -> None:
    """Apply the rule ``candidate`` for ``delay``; a learning-rate scheduler already
    built (``sched``) has its base rates scaled as the rates are."""
    before = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        adam = "betas" in group
        hyper = Hyper(group["lr"], group["betas"][0] if adam else group["momentum"], adam)
        if candidate == "dreampipe":
            hyper = compensated(hyper, delay)
        elif candidate == "momentum":
            hyper = _former(hyper, delay)
        elif candidate == "momentum-only":
            hyper = Hyper(hyper.lr, max(0.0, hyper.momentum - delay / (delay + 1)))
        elif candidate == "damping":
            hyper = Hyper(hyper.lr, max(0.0, 1 - (1 - hyper.momentum) * (delay + 1)))
        elif candidate == "zero":
            hyper = Hyper(hyper.lr, 0.0 if delay else hyper.momentum)
        elif candidate == "momentum-lr":
            hyper = _former(hyper, delay)
            hyper = Hyper(hyper.lr / (delay + 1), hyper.momentum, adam)
        elif candidate == "lr":
            hyper = Hyper(hyper.lr / (delay + 1), hyper.momentum)
        group["lr"] = hyper.lr
        if adam:
            group["betas"] = (hyper.momentum, group["betas"][1])
        else:
            group["momentum"] = hyper.momentum
    if sched is not None:
        sched.base_lrs = [base * group["lr"] / old for base, group, old
                          in zip(sched.base_lrs, opt.param_groups, before, strict=True)]


def _former(hyper: Hyper, delay: int) -> Hyper:
    """The ``momentum`` candidate: ``beta1`` lowered too, Adam's lr keeping its spread."""
    low = max(0.0, hyper.momentum - delay / (delay + 1))
    if not hyper.adaptive:
        return Hyper(hyper.lr, low)
    spread = math.sqrt((1 - hyper.momentum) / (1 + hyper.momentum)) / math.sqrt(
        (1 - low) / (1 + low))
    return Hyper(hyper.lr * spread, low, True)


def _next_step(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Tensor]:
    """The step, per parameter name, that ``opt`` would take next without a new gradient
    (subtracted from the weights): AdamW's ``lr (m_hat / (sqrt(v_hat) + eps) + wd w)``,
    SGD's ``lr * momentum_buffer``; zero before the first update."""
    steps = {}
    for group in opt.param_groups:
        for p in (q for q in group["params"] if id(q) in names):
            state = opt.state.get(p, {})
            step = torch.zeros_like(p)
            if "exp_avg" in state:
                b1, b2 = group["betas"]
                n = float(state["step"])
                m_hat = state["exp_avg"] / (1 - b1 ** n)
                v_hat = state["exp_avg_sq"] / (1 - b2 ** n)
                decay = group["weight_decay"] if isinstance(opt, torch.optim.AdamW) else 0.0
                step = group["lr"] * (m_hat / (v_hat.sqrt() + group["eps"]) + decay * p.detach())
            elif state.get("momentum_buffer") is not None:
                step = group["lr"] * state["momentum_buffer"]
            steps[names[id(p)]] = step.detach().clone()
    return steps


def _mean_square(opt: torch.optim.Optimizer, p: Tensor, g: Tensor,
                 own: dict[int, Tensor]) -> tuple[Tensor, float]:
    """DC-ASGD-a's running mean of ``g*g`` with ``g`` in, and its ``eps``: Adam's
    ``exp_avg_sq`` updated as its step will and bias corrected; for SGD ``own``'s
    mean (decay :data:`_SGD_MEAN_SQUARE_DECAY`, updated here)."""
    group = next(gr for gr in opt.param_groups if any(q is p for q in gr["params"]))
    state = opt.state.get(p, {})
    if "betas" in group:
        b2 = group["betas"][1]
        n = float(state["step"]) + 1 if state else 1.0
        sq = state["exp_avg_sq"] if state else torch.zeros_like(g)
        return (b2 * sq + (1 - b2) * g * g) / (1 - b2 ** n), group["eps"]
    decay = _SGD_MEAN_SQUARE_DECAY
    own[id(p)] = decay * own.get(id(p), g * g) + (1 - decay) * g * g
    return own[id(p)], 1e-8


def simulate(workload: str, schedule: str, workers: int, candidate: str, seed: int,
             sgd: tuple[float, float] = (0.05, 0.9), epochs: int | None = None) -> list[float]:
    """The held-out figure (accuracy, or loss for the language models) after each epoch,
    0 first; ``sgd``: an SGD workload's learning rate and momentum; ``epochs``: the
    task's when None. chars on 8 workers has 8 blocks."""
    torch.manual_seed(seed)
    recipe = _RECIPES[candidate]
    task = tasks.task(workload, seed, sgd, blocks=8 if workers >= 8 else 4)
    model: nn.Sequential = task["model"]
    cuts = _cuts(len(model), workers)
    stages = [model[cuts[s]:cuts[s + 1]] for s in range(workers)]
    ties = updates.untie(stages)
    copies = {(s, name) for s, name, _, _ in ties}
    delays = _delays(schedule, workers)
    opts = [updates.optimizer(task["optimizer"], [p for k, p in m.named_parameters()
                                                  if (s, k) not in copies],
                              d / workers if recipe.nesterov else None)
            for s, (m, d) in enumerate(zip(stages, delays, strict=True))]
    predicting = [recipe.predict != "segment"
                  or any(predicts(hyper_of(g), d) for g in o.param_groups)
                  for o, d in zip(opts, delays, strict=True)]
    if not recipe.warmup:
        for opt, d in zip(opts, delays, strict=True):
            _settings(opt, recipe.settings, d)
    if schedule == "pipedream-settings":  # pipedream's settings, no delay: what they cost
        delays = [0] * workers
    scheds = [task["lr_scheduler"](o) if task["lr_scheduler"] else None for o in opts]
    names = [{id(p): k for k, p in m.named_parameters()} for m in stages]
    history: list[dict[int, dict[str, Tensor]]] = [{0: _snap(m)} for m in stages]
    ema: list[dict[int, dict[str, Tensor]]] = [
        {0: {k: torch.zeros_like(w) for k, w in h[0].items()}} for h in history]
    ahead_steps = [{0: _next_step(o, n)} for o, n in zip(opts, names, strict=True)]
    own_sq: dict[int, Tensor] = {}
    state = updates.StepState(workers)
    figures = [task["evaluate"](model)]
    t = 0
    for epoch in range(task["epochs"] if epochs is None else epochs):
        start = t  # the runtime drains at each epoch's end: a segment starts afresh
        state.restart()
        sync = recipe.warmup and epoch == 0
        if recipe.warmup and epoch == 1:
            for opt, d, sched in zip(opts, delays, scheds, strict=True):
                _settings(opt, recipe.settings, d, sched)
        batches = list(task["epoch"]())
        for i, (x, y) in enumerate(batches):
            model.train()
            leaves = []
            for s, m in enumerate(stages):
                v = max(start, t - (0 if sync else delays[s]))
                k = t - v
                ahead = (min(k, v) if recipe.predict == "last"
                         else k if recipe.predict == "every" and v > start
                         else k if recipe.predict == "segment" and v > start
                         and predicting[s] else 0)
                ahead += recipe.ahead if ahead else 0
                base = history[s][v - 1] if ahead else {}
                params = {n: (w + ahead * (w - base[n]) if ahead else w.detach())
                          .requires_grad_(True) for n, w in history[s][v].items()}
                if recipe.predict == "optimizer":
                    params = {n: (w.detach() - k * ahead_steps[s][v][n]).requires_grad_(True)
                              for n, w in params.items()}
                if recipe.predict == "ema" and k:
                    params = {n: (w.detach() + k * ema[s][v][n]).requires_grad_(True)
                              for n, w in params.items()}
                for copy, n, owner, owner_name in ties if recipe.tied_owner else ():
                    if copy == s:  # the copy runs on the owner's weights of this minibatch
                        params[n] = leaves[owner][owner_name].detach().requires_grad_(True)
                leaves.append(params)
                x = functional_call(m, params, (x,))
            loss = task["loss_fn"](x, y)
            keys = [(s, n) for s, params in enumerate(leaves) for n in params]
            grads = dict(zip(keys, torch.autograd.grad(
                loss, [p for params in leaves for p in params.values()]), strict=True))
            for s, n, owner, owner_name in ties:  # a tied weight's copies sum their gradients
                grads[owner, owner_name] = grads[owner, owner_name] + grads.pop((s, n))
            if task["clip"] is not None:
                norm = torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(g) for g in grads.values()]))
                grads = {key: g * min(1.0, task["clip"] / (float(norm) + 1e-6))
                         for key, g in grads.items()}
            last = i == len(batches) - 1
            for s, m in enumerate(stages):
                for n, p in m.named_parameters():
                    if (s, n) in copies:
                        continue
                    g = grads[s, n]
                    if recipe.dc:
                        scale: Tensor | float = recipe.dc
                        if recipe.adaptive:
                            sq, eps = _mean_square(opts[s], p, g, own_sq)
                            scale = recipe.dc / (sq + eps).sqrt()
                        g = g + scale * g * g * (p.detach() - leaves[s][n].detach())
                    state.add(s, p, g)
                window = delays[s] + 1 if recipe.accumulate else 1
                if state.ready(s, window) or last:
                    factor = updates.anneal(delays[s], t, len(batches)) if recipe.anneal else 1.0
                    state.step(s, opts[s], scheds[s], factor,
                               delays[s] if recipe.feedback else 0)
            for s, n, owner, owner_name in ties:
                stages[s].get_parameter(n).data.copy_(
                    stages[owner].get_parameter(owner_name).data)
            t += 1
            for s, m in enumerate(stages):
                history[s][t] = _snap(m)
                if recipe.predict == "optimizer":
                    ahead_steps[s][t] = _next_step(opts[s], names[s])
                if recipe.predict == "ema":
                    gamma = _PIPEMARE_D ** (1 / max(1, delays[s]))
                    ema[s][t] = {n: gamma * ema[s][t - 1][n] + (1 - gamma) * (
                        w - history[s][t - 1][n]) for n, w in history[s][t].items()}
                for old in [v for v in history[s] if v < t - max(delays) - 2]:
                    for store in (history[s], ema[s], ahead_steps[s]):
                        store.pop(old, None)
        figures.append(task["evaluate"](model))
    return figures


def _snap(m: nn.Module) -> dict[str, Tensor]:
    return {k: p.detach().clone() for k, p in m.named_parameters()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=tasks.WORKLOADS, default="digits")
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--schedules", nargs="+", default=["sync", "pipedream", "2bw"],
                        choices=("sync", "pipedream", "2bw", "pipedream-settings"))
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sgd", type=float, nargs=2, default=[0.05, 0.9],
                        metavar=("LR", "MOMENTUM"), help="the digits' SGD settings")
    parser.add_argument("--epochs", type=int, help="epochs to train (default: the study's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for workers, schedule, seed in itertools.product(args.workers, args.schedules, args.seeds):
        for candidate in (["none"] if schedule == "sync" else args.candidates):
            figures = simulate(args.workload, schedule, workers, candidate, seed,
                               tuple(args.sgd), args.epochs)
            print(f"{args.workload} {workers} {schedule:9} {candidate:8} seed {seed} "
                  f"sgd {args.sgd[0]:g}/{args.sgd[1]:g}: "
                  + " ".join(f"{f:.3f}" for f in figures[1:]), flush=True)
            print(json.dumps({"workload": args.workload, "workers": workers, "sgd": args.sgd,
                              "schedule": schedule, "candidate": candidate, "seed": seed,
                              "figures": figures}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
