"""``dreampipe train`` and ``demo``: train models for real.

``train`` profiles, plans and trains one model on local worker processes
(or under ``torchrun``); ``demo`` is the README's main job. The work is
done by :mod:`dreampipe.commands.train_run` (on :class:`dreampipe.Pipeline`)
and :mod:`dreampipe.commands.demo`; this module parses, checks and prints.
``bench`` is :mod:`dreampipe.cli.bench_command`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreampipe.cli.output_paths import check_output_paths, check_run_paths
from dreampipe.errors import ConfigError
from dreampipe.quantities import format_bytes, parse_bytes
from dreampipe.runplan.schedule_choice import Semantics
from dreampipe.scheduling.actions import ScheduleKind

if TYPE_CHECKING:
    from dreampipe.api.config import TrainConfig
    from dreampipe.commands.train_plan import TrainRequest

__all__ = ["PRECISIONS", "parse_model_args", "register"]

_AUTO = "auto"
_SCHEDULES = [_AUTO, *(k.value for k in ScheduleKind)]

_DATASETS = ("synthetic", "digits", "mnist")


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``train`` and ``demo`` sub-commands."""
    _register_train(sub)
    _register_demo(sub)


# ---- train ------------------------------------------------------------------
def _register_train(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with pipeline parallelism on local workers or under torchrun",
        description=(
            "Profile MODEL on this machine, plan it for the workers at hand (or use --plan, or "
            "force a partition with --config/--stages), print the predicted throughput, then "
            "train: on one machine dreampipe starts --workers local processes itself (gloo, one "
            "thread each); under 'torchrun --nnodes .. --nproc-per-node ..' it uses torchrun's "
            "processes (RANK/WORLD_SIZE) instead and prints on rank 0 only."
        ),
    )
    p.add_argument("model", metavar="MODEL",
                   help="zoo name, package.module:function or path/to/file.py:function "
                        "returning a ModelSpec")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="size the model, e.g. --model-arg layers=4 --model-arg width=256 "
                        "(repeatable; see the zoo function's parameters)")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: the --config's total, else 2); "
                        "under torchrun the world size is used and this must match it if given")
    g = p.add_argument_group("plan")
    g.add_argument("--plan", metavar="FILE", help="use this plan JSON (from 'dreampipe plan')")
    g.add_argument("--profile", metavar="FILE",
                   help="plan and predict with this layer profile instead of profiling "
                        "MODEL first (from 'OMP_NUM_THREADS=1 dreampipe profile MODEL "
                        "--model-arg .. --batch-size N -o FILE', N the samples a worker "
                        "computes at once; a mismatch says the command): it starts seconds "
                        "sooner, but the prediction lacks what workers computing side by "
                        "side measure of each other")
    g.add_argument("--config", help="force replicas per stage, e.g. 2-1 or straight or 2 (DP); "
                                    "without --stages the planner places the cuts")
    g.add_argument("--stages", help="force the first layer of each stage, e.g. 0,4")
    g.add_argument("--memory", metavar="SIZE",
                   help="memory each worker has for training, e.g. 2GB: the planner keeps "
                        "every stage's predicted peak within it; when no layer plan fits it "
                        "splits every layer over the workers (docs/operator-partitioning.md), "
                        "and when nothing fits it is an error (default: no limit; see "
                        "docs/memory.md)")
    g.add_argument("--measure-memory", action="store_true", default=None,
                   help="measure each rank's peak memory, the most its tensors hold at "
                        "once, and print it beside the planner's prediction; on CPU every "
                        "operation is then counted, which makes training slower (a quarter "
                        "on the transformer): time runs without it")
    g = p.add_argument_group("training", "--settings FILE.toml or .json sets any TrainConfig "
                             "field (schedule = \"1f1b-flush\", max_grad_norm = 1.0, ...); "
                             "a flag given on the command line wins over the file.")
    g.add_argument("--settings", metavar="FILE", help="a TrainConfig, as TOML or JSON")
    g.add_argument("--schedule", choices=_SCHEDULES, default=None,
                   help="pipedream: async 1F1B with weight stashing (default); 2bw: "
                        "PipeDream-2BW (async, two weight versions); 1f1b-flush, "
                        "gpipe: synchronous microbatched; zb-h1, zb-h2: zero bubble (the "
                        "backward split into input and weight gradients); interleaved-1f1b: "
                        "--virtual-stages stages per worker; zbv, dualpipev: zero bubble "
                        "and DualPipeV, 2 stages per worker in a V; dp: data parallel; naive: one "
                        "microbatch at a time; auto: the fastest of --semantics on the plan "
                        "that fits --memory, simulated, with the reasons")
    g.add_argument("--semantics", choices=[s.value for s in Semantics], default=None,
                   help="with --schedule auto: sync (default; zb-h1, zb-h2, 1f1b-flush, gpipe, "
                        "as one process trains), async (2bw, pipedream: stale weights) or "
                        "any: both, weighed by the epochs to target dreampipe's convergence "
                        "study measured (docs/design.md §12)")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="interleaved-1f1b: V stages per worker, stage s on worker s mod "
                        "workers, cut for balanced compute; with --config 2-1, positions "
                        "replicated so (stage s on position s mod 2), each stage's compute "
                        "over its replicas balanced (default: a --plan file's own, which V "
                        "may only repeat, else 1)")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="fp32 (default); bf16-mixed, fp16-mixed: forwards under autocast, "
                        "32-bit weights (fp16 with a loss scale all stages share: an "
                        "overflow skips the update everywhere and lowers it); bf16: 16-bit "
                        "weights and gradients, 32-bit master weights and optimizer state. "
                        "Stages send in 16 bits in all but fp32")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="shard a replicated stage over its replicas (ZeRO): 1 its optimizer "
                        "state, 2 also its gradients (each microbatch's reduce-scattered as "
                        "its backward ends), 3 also its weights between uses (each layer's "
                        "gathered as it runs where the replicas run as many microbatches an "
                        "update, else all for the update; synchronous schedules only: with "
                        "no --schedule nor --settings, 1f1b-flush); 0 none "
                        "(default). A plan file's stage may set its own (\"zero\": 1)")
    recompute = g.add_mutually_exclusive_group()
    recompute.add_argument("--recompute-blocks", type=int, default=None, metavar="K",
                           help="each stage recomputes its first K blocks (transformer layers) "
                                "in the backward, keeping only their inputs: less activation "
                                "memory for one more forward of them")
    recompute.add_argument("--recompute", choices=("selective",), default=None,
                           dest="recompute_attention",
                           help="selective: every block recomputes only its attention "
                                "(Megatron-LM's selective recomputation)")
    g.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="default: sgd")
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    g.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: 0)")
    g.add_argument("--batch-size", type=int, default=32,
                   help="samples per weight update (default: 32)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per update for the synchronous schedules; must divide "
                        "--batch-size; pipedream needs 1 (default: 1)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None,
                        help="weight updates to run (pipedream: minibatches); default 10")
    length.add_argument("--epochs", type=float, default=None,
                        help="passes over the training set instead of --steps")
    g.add_argument("--seed", type=int, default=None,
                   help="weights and data order (default: 0)")
    g.add_argument("--dataset", choices=_DATASETS, default="synthetic",
                   help="synthetic random data (default), scikit-learn's 8x8 digits, or an "
                        "MNIST IDX directory given by --data-dir")
    g.add_argument("--data-dir", help="directory of the MNIST IDX files for --dataset mnist")
    g.add_argument("--seq-lengths", metavar="MIN:MAX",
                   help="token sequences of a changing length: each step's cut to a length "
                        "drawn from MIN..MAX (under --seed), dimension 1 declared variable; the "
                        "model takes [batch, tokens] of MAX tokens at least (transformer "
                        "--model-arg seq_len=MAX); the report gives the median time of "
                        "the steps with a new length against those with a repeated one "
                        "(--json: seq_lengths)")
    g.add_argument("--vertical-sync", action="store_true", default=None,
                   help="every stage runs a minibatch with its input stage's weight version")
    g.add_argument("--no-stash", action="store_false", dest="stash", default=None,
                   help="turn weight stashing off (naive async pipelining, to show why it "
                        "matters)")
    g.add_argument("--no-compensation", action="store_false", dest="compensate", default=None,
                   help="pipedream and 2bw: train every stage on its stale weights as they "
                        "are, with the optimizer's settings as given (staleness compensation, "
                        "on by default, lowers SGD's momentum by each stage's delay, and "
                        "predicts the weights of Adam's stages; docs/convergence.md)")
    g.add_argument("--timeout", type=float, default=None, dest="timeout_s",
                   help="seconds any rank waits for a peer before failing (default: 60)")
    g.add_argument("--on-nonfinite", choices=("stop", "skip"), default=None,
                   help="a NaN or inf stage output or loss: stop with an error naming the "
                        "minibatch and the stage (default), or skip that minibatch's update "
                        "(synchronous schedules)")
    g = p.add_argument_group(
        "checkpoints and restarts",
        "Under 'torchrun --max-restarts N', give the same command --checkpoint-dir, "
        "--checkpoint-every and --resume: the first start finds no checkpoint and starts at "
        "step 0; a group restarted after a rank died (or on fewer processes, re-planned for "
        "them) continues from the last committed checkpoint.",
    )
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save checkpoints as DIR/step-N (torch.distributed.checkpoint); saves "
                        "there that never committed (a crash mid-save) are removed at the start")
    g.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="save every N weight updates (pipedream: minibatches) into "
                        "--checkpoint-dir")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest committed checkpoint in --checkpoint-dir, "
                        "or start at step 0 if there is none yet; --steps stays the total (a "
                        "checkpoint already at --steps: nothing left to train, exit 0)")
    g.add_argument("--data-log", metavar="FILE",
                   help="append one JSON line per minibatch trained (its index and a hash of "
                        "its samples) and one per start or restart (the step it resumed at)")
    g = p.add_argument_group("output")
    g.add_argument("--trace", metavar="OUT.json",
                   help="write every rank's measured actions as a Chrome trace")
    g.add_argument("--timeline", metavar="OUT.png", help="draw the measured timeline")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (samples_per_s, final_loss, accuracy, "
                        "predicted_samples_per_s, memory per rank, ...) and nothing else there")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)


def parse_model_args(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """``["layers=4", "width=0.5", "act=relu"]`` into typed ``(key, value)`` pairs."""
    out: list[tuple[str, Any]] = []
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--model-arg {item!r}: write KEY=VALUE, e.g. layers=4")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        out.append((key, value))
    return tuple(out)


#: ``Precision``'s values (the parser loads no torch; a test holds them equal).
PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")

#: The flags that set a TrainConfig field, by the field (argparse's dest is the field).
_CONFIG_FLAGS = ("schedule", "semantics", "virtual_stages", "microbatches", "seed", "precision",
                 "vertical_sync", "stash", "compensate", "timeout_s", "on_nonfinite",
                 "recompute_blocks", "zero", "measure_memory")


def _config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of ``--settings`` with the flags given on the command line over it."""
    from dreampipe.api.config import TrainConfig
    from dreampipe.commands.seq_lengths import with_lengths

    given = {k: getattr(args, k) for k in _CONFIG_FLAGS if getattr(args, k) is not None}
    if args.trace or args.timeline:
        given["record_events"] = True
    if args.recompute_attention:
        given["recompute_attention"] = True

    def made(given: dict[str, Any]) -> TrainConfig:
        return TrainConfig.load(args.settings, given) if args.settings else TrainConfig(**given)

    if args.schedule not in (None, "auto"):
        _check_named_schedule(args)
    try:
        return with_lengths(made(given), args.seq_lengths)
    except ConfigError as exc:  # the default schedule (pipedream) keeps versions in flight
        chosen = args.schedule is not None or args.settings
        if chosen or (args.zero or 0) < 3 or "schedule" not in exc.parameters:
            raise
    print("dreampipe train: --zero 3 needs a synchronous schedule; training with "
          "--schedule 1f1b-flush", file=sys.stderr)
    return with_lengths(made({**given, "schedule": "1f1b-flush"}), args.seq_lengths)


def _check_named_schedule(args: argparse.Namespace) -> None:
    """Refuse flags given beside ``--schedule`` that ask for the other kind of schedule or
    that change nothing under it (a settings file's fields are left to it)."""
    from dreampipe.cli.plan_schedule import check_schedule_flags
    from dreampipe.scheduling.actions import ScheduleKind

    check_schedule_flags(args)
    kind = ScheduleKind(args.schedule)
    if args.compensate is False and kind.synchronous:
        raise ConfigError(f"--no-compensation with --schedule {kind.value}, which trains on no "
                          "stale weights, so there is nothing to compensate; drop "
                          "--no-compensation, or use an asynchronous schedule (pipedream, 2bw)")


def _request(args: argparse.Namespace) -> TrainRequest:
    """The train job the arguments ask for."""
    from dreampipe.commands.seq_lengths import parse_lengths
    from dreampipe.commands.train_config import TrainOptions
    from dreampipe.commands.train_plan import PlanSource, TrainRequest
    from dreampipe.runtime.runner_options import OptimizerKind

    run = TrainOptions(
        model=args.model, model_kwargs=parse_model_args(args.model_arg), config=_config(args),
        seq_lengths=parse_lengths(args.seq_lengths),
        optimizer=OptimizerKind(args.optimizer), lr=args.lr, momentum=args.momentum,
        minibatch_size=args.batch_size, steps=10 if args.steps is None else args.steps,
        dataset=args.dataset, data_dir=args.data_dir,
        progress=not args.no_progress,
    )
    return TrainRequest(
        run=run,
        plan=PlanSource(path=args.plan, config=args.config, stages=args.stages),
        profile=args.profile,
        workers=args.workers,
        epochs=args.epochs,
        exact_steps=args.steps is not None,
        memory_bytes=None if args.memory is None else parse_bytes(args.memory,
                                                                  require_unit=True),
    )


def _train(args: argparse.Namespace) -> int:
    from dreampipe.commands.seq_lengths import lengths_line, longest_note
    from dreampipe.commands.train_run import Checkpoints, run_train
    from dreampipe.commands.train_share import torchrun_world

    check_output_paths(args.trace, args.timeline)
    check_run_paths(args.data_log, args.checkpoint_dir)
    checkpoints = Checkpoints(
        directory=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        every=args.checkpoint_every, resume=args.resume,
        data_log=Path(args.data_log) if args.data_log else None,
    )
    say = _printer(args.json)
    report = run_train(_request(args), torchrun=torchrun_world(), say=say,
                       checkpoints=checkpoints)
    if report is None:
        return 0
    res = report.result
    if args.trace:
        from dreampipe.simulation.chrome_trace import write_chrome_trace

        write_chrome_trace(list(res.events), args.trace)
        say(f"trace: {args.trace}")
    if args.timeline:
        from dreampipe.simulation.timeline import draw_timeline

        title = f"{args.model} {report.plan.config} {report.config.schedule} (measured)"
        draw_timeline(list(res.events), args.timeline, title=title)
        say(f"timeline: {args.timeline}")
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        ratio = res.samples_per_s / report.predicted_samples_per_s \
            if report.predicted_samples_per_s > 0 else float("nan")
        say(f"throughput: measured {res.samples_per_s:.1f} samples/s, predicted "
            f"{report.predicted_samples_per_s:.1f} (measured/predicted {ratio:.2f}"
            f"{longest_note(args.seq_lengths)})")
        say(f"final loss {res.final_loss:.4f}"
            + (f", test accuracy {res.accuracy:.2%}" if res.accuracy is not None else ""))
        if "seq_lengths" in summary:
            say(lengths_line(summary["seq_lengths"]))
        for line in _memory_table(report.memory_rows()):
            say(line)
    return 0


def _memory_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each rank's peak memory above its baseline against the planner's prediction."""
    if not rows:
        return []
    lines = ["memory per rank (the most its tensors held, docs/memory.md):",
             f"  {'rank':>4} {'stage':>5} {'predicted':>10} {'measured':>10} {'ratio':>6}"]
    for r in rows:
        predicted = "-" if r["predicted_bytes"] is None else format_bytes(r["predicted_bytes"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"  {r['rank']:>4} {r['stage']:>5} {predicted:>10} "
                     f"{format_bytes(r['measured_bytes']):>10} {ratio:>6}")
    return lines


def _printer(quiet_stdout: bool) -> Any:
    """Human lines go to stdout, or to stderr when stdout is reserved for JSON."""
    stream = sys.stderr if quiet_stdout else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    return say


# ---- demo -------------------------------------------------------------------
def _register_demo(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "demo",
        help="profile, plan and train a CNN on handwritten digits with PipeDream vs DP",
        description=(
            "The main job: profile the 'cnn' zoo model on scikit-learn's handwritten digits, "
            "plan it for 2 local workers, train it with PipeDream (async 1F1B, weight "
            "stashing) and, for comparison, with data parallelism for the same epochs, then "
            "print test accuracy and throughput of both and write the measured PipeDream "
            "timeline as a PNG. Under a minute on 2 CPU cores."
        ),
    )
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the training digits (default: the demo's tuned value)")
    p.add_argument("--out", default="out/demo",
                   help="directory for the timeline PNG, trace and plan (default: out/demo)")
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from dreampipe.commands.demo import DemoOptions, run_demo

    if not args.out.strip():  # Path("") is ".": the files would land in the current directory
        raise ConfigError(f"--out {args.out!r}: name a directory for the demo's timeline, "
                          "trace and plan, e.g. --out out/demo")
    opts = DemoOptions(seed=args.seed, out_dir=Path(args.out), progress=not args.no_progress)
    if args.epochs is not None:
        opts = opts.with_epochs(args.epochs)
    run_demo(opts, say=_printer(False))
    return 0
