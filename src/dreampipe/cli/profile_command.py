"""``dreampipe profile`` and ``dreampipe show``: measure a model, print a profile.

``show`` takes a file, a bundled PipeDream profile (``pipedream:vgg16``) or
a profile by shape (``gpt:...`` with ``--topology``, whose device times it);
``show --list`` lists the bundled ones.

``profile MODEL`` takes what every command takes
(:mod:`dreampipe.models.resolve`): a zoo name, ``package.module:function`` or
``path/to/file.py:function``. The function is called with no arguments (or
with ``batch_size=N`` when ``--batch-size`` is given and it takes one) and
returns a ModelSpec, or ``(model, sample_input, loss_fn)`` or
``(model, sample_input, loss_fn, target)``: with a target the loss is
``loss_fn(output, target)``, without one ``loss_fn(output)``.

The model is timed again at a small batch (``--small-batch``, by default an
eighth), so that a plan of many small microbatches is priced with what each
call pays whatever its batch (:mod:`dreampipe.profiling.fixed_costs`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from dreampipe.cli.links import GPT_HELP, TOPOLOGY_HELP, profile_on
from dreampipe.cli.output_paths import check_output_file
from dreampipe.cli.profile_table import (
    format_bundled_list,
    format_profile_summary,
    format_profile_table,
)
from dreampipe.errors import ProfileError
from dreampipe.profiling.bundled import bundled_profiles
from dreampipe.profiling.gpt_spec import is_gpt_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph

if TYPE_CHECKING:
    from dreampipe.models.resolve import ModelSample
    from dreampipe.models.spec import ModelSpec

__all__ = ["register"]

_FILE_HELP = (
    "MODEL is a zoo name, package.module:function or path/to/file.py:function; the function "
    "(called with no arguments, or with batch_size=N when --batch-size is given) returns a "
    "ModelSpec, or (model, sample_input, loss_fn) or (model, sample_input, loss_fn, target). "
    "With a target the loss is loss_fn(output, target); without one, loss_fn(output)."
)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``profile`` and ``show`` sub-commands."""
    from dreampipe.models import ZOO

    profile = sub.add_parser(
        "profile",
        help="measure a model layer by layer and write its profile",
        description=(
            "Measure forward and backward time, output activation size and parameter size of "
            "every layer (warm-up, then the median of several repeats), print a per-layer "
            "table and optionally save it as JSON for 'dreampipe plan'. " + _FILE_HELP
        ),
        epilog=f"Zoo models: {', '.join(sorted(ZOO))}.",
    )
    profile.add_argument("model", metavar="MODEL",
                         help="zoo name, package.module:function or path/to/file.py:function")
    profile.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                         help="size the model, e.g. --model-arg layers=4 (repeatable; as for "
                              "'dreampipe train')")
    profile.add_argument(
        "--batch-size", type=int, metavar="N",
        help="minibatch size to measure at (default: the zoo model's own default)",
    )
    profile.add_argument(
        "--small-batch", type=int, metavar="N",
        help="also time the layers at N samples, so that plans price what a microbatch pays "
             "whatever its size (default: an eighth of the batch; 0: do not)",
    )
    profile.add_argument(
        "-o", "--output", type=Path, metavar="FILE.json",
        help="write the profile here as JSON (read it back with 'dreampipe show')",
    )
    profile.add_argument(
        "--repeats", type=int, default=5, metavar="R",
        help="timed runs per layer; the median is kept (default: 5)",
    )
    profile.add_argument(
        "--warmup", type=int, default=2, metavar="W",
        help="untimed runs per layer before timing (default: 2)",
    )
    profile.set_defaults(func=_profile)

    show = sub.add_parser(
        "show",
        help="print a profile (dreampipe JSON, PipeDream graph.txt or a bundled one)",
        description=(
            "Print the per-layer table of a profile written by 'dreampipe profile -o', of a "
            "PipeDream graph.txt, or of a bundled PipeDream profile (pipedream:NAME), with the "
            "model, batch size, layer count, and whether the layers form a chain or a DAG. "
            "--list lists the bundled profiles."
        ),
        epilog="Example: dreampipe show pipedream:gnmt; dreampipe show --list; dreampipe show "
               "gpt:layers=2,hidden=512,heads=8,seq=128,vocab=1000 -t dgx-a100:1",
    )
    what = show.add_mutually_exclusive_group(required=True)
    what.add_argument("file", metavar="PROFILE", nargs="?",
                      help=f"profile JSON, graph.txt, pipedream:NAME, or {GPT_HELP}")
    what.add_argument("--list", action="store_true",
                      help="list the bundled PipeDream profiles (V100, by their authors)")
    show.add_argument("--topology", "-t", metavar="T",
                      help=f"for a gpt: profile, the cluster whose device times it: "
                           f"{TOPOLOGY_HELP}")
    show.set_defaults(func=_show)


def _profile(args: argparse.Namespace) -> int:
    from dreampipe.cli.train_command import parse_model_args
    from dreampipe.models.resolve import memory_error, resolve

    if args.batch_size is not None and args.batch_size < 1:
        raise ProfileError(f"--batch-size {args.batch_size}: give a positive minibatch size")
    if args.small_batch is not None and args.small_batch < 0:
        raise ProfileError(f"--small-batch {args.small_batch}: give a positive batch, or 0 to "
                           f"time one batch only")
    check_output_file("-o", args.output, "profile.json")
    sized = parse_model_args(args.model_arg)
    model = resolve(args.model, sized, batch_size=args.batch_size)
    try:
        graph = _measure(args, model, sized)
    except (RuntimeError, MemoryError) as exc:
        short = memory_error(args.model, sized, exc)
        if short is None:
            raise
        raise short from None
    if args.output is not None:  # before printing: a reader that stops early loses nothing
        graph.save(args.output)
    _print(graph)
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0


def _measure(args: argparse.Namespace, model: ModelSpec | ModelSample,
             sized: tuple[tuple[str, Any], ...]) -> LayerGraph:
    """``model`` profiled layer by layer, and again at the small batch, with progress
    bars on stderr."""
    from dreampipe.models.resolve import ModelSample
    from dreampipe.profiling.fixed_costs import default_small_batch, with_small_batch

    graph = _measure_at(args, model, None)
    if not isinstance(model, ModelSample):
        graph = replace(graph, meta={**graph.meta,
                                     "model_kwargs": [[k, v] for k, v in sized]})
    small = (default_small_batch(graph.batch_size) if args.small_batch is None
             else args.small_batch)
    if small and args.small_batch is not None and small >= graph.batch_size:
        raise ProfileError(f"--small-batch {small}: give fewer samples than the batch "
                           f"profiled, {graph.batch_size}, or 0 to time one batch only")
    if small:
        try:
            graph = with_small_batch(graph, _measure_at(args, model, small))
        except (RuntimeError, ValueError) as exc:  # a layer refusing so few samples
            print(f"note: timing at a batch of {small} failed ({exc}); plans scale this "
                  f"profile's times in proportion to the microbatch (--small-batch N sets "
                  f"another size)", file=sys.stderr)
    return graph


def _measure_at(args: argparse.Namespace, model: ModelSpec | ModelSample, small: int | None
                ) -> LayerGraph:
    """``model`` profiled at its batch, or at ``small`` samples (a sample's first ones)."""
    from dreampipe.models.resolve import ModelSample
    from dreampipe.profiling.profiler import profile_model, profile_spec

    what = f"profiling {args.model}" + ("" if small is None else f" at batch {small}")
    with tqdm(desc=what, unit="pass", file=sys.stderr, disable=None) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        if isinstance(model, ModelSample):
            sample, target = model.sample_input, model.target
            if small is not None:
                sample, target = _first(sample, small), _first(target, small)
            return profile_model(
                model.module, sample, model.loss_fn, target, warmup=args.warmup,
                repeats=args.repeats, progress=progress, name=model.name,
            )
        return profile_spec(model, small or args.batch_size, warmup=args.warmup,
                            repeats=args.repeats, progress=progress)


def _first(value: Any, count: int) -> Any:
    """``value``'s tensors cut to their first ``count`` samples (the batch is the first
    dimension, as the profiler reads it)."""
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t[:count] if t.dim() else t, value)


def _show(args: argparse.Namespace) -> int:
    if args.list:
        print(format_bundled_list([(p.spec, load_graph(p.spec)) for p in bundled_profiles()]))
        return 0
    if args.topology is None:
        _print(load_graph(args.file))
    elif not is_gpt_spec(str(args.file)):
        raise ProfileError(f"-t {args.topology} times a profile by shape (gpt:...) on its "
                           f"device; {str(args.file)!r} holds its own times: drop -t")
    else:
        from dreampipe.planning.topology import Topology

        _print(profile_on(args.file, Topology.parse(args.topology)))
    return 0


def _print(graph: LayerGraph) -> None:
    print(format_profile_summary(graph))
    print(format_profile_table(graph))
