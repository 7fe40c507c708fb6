"""``dreampipe profile`` and ``dreampipe show``: measure a model, print a profile.

``profile MODEL`` takes a zoo name or ``path/to/file.py:function``. The
function is called with no arguments (or with ``batch_size=N`` when
``--batch-size`` is given) and returns ``(model, sample_input, loss_fn)`` or
``(model, sample_input, loss_fn, target)``: with a target the loss is
``loss_fn(output, target)``, without one ``loss_fn(output)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from dreampipe.cli.profile_table import format_profile_summary, format_profile_table
from dreampipe.errors import ProfileError
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["register"]

_FILE_HELP = (
    "MODEL is a zoo name or path/to/file.py:function; the function (called with no "
    "arguments, or with batch_size=N when --batch-size is given) returns (model, "
    "sample_input, loss_fn) or (model, sample_input, loss_fn, target). With a target the "
    "loss is loss_fn(output, target); without one, loss_fn(output)."
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
    profile.add_argument("model", metavar="MODEL", help="zoo name or path/to/file.py:function")
    profile.add_argument(
        "--batch-size", type=int, metavar="N",
        help="minibatch size to measure at (default: the zoo model's own default)",
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
        help="print a saved profile (dreampipe JSON or PipeDream graph.txt)",
        description=(
            "Print the per-layer table of a profile written by 'dreampipe profile -o' or of a "
            "PipeDream graph.txt, with the model, batch size, layer count, and whether the "
            "layers form a chain or a DAG."
        ),
    )
    show.add_argument("file", metavar="FILE", type=Path, help="profile JSON or graph.txt")
    show.set_defaults(func=_show)


def _profile(args: argparse.Namespace) -> int:
    from dreampipe.models import ZOO, get_model
    from dreampipe.profiling.profiler import profile_model, profile_spec

    model_ref: str = args.model
    if args.batch_size is not None and args.batch_size < 1:
        raise ProfileError(f"--batch-size {args.batch_size}: give a positive minibatch size")
    with tqdm(desc=f"profiling {model_ref}", unit="pass", file=sys.stderr,
              disable=None) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        if ":" in model_ref and model_ref.rpartition(":")[0].endswith(".py"):
            model, sample, loss_fn, target = _load_user_model(model_ref, args.batch_size)
            graph = profile_model(
                model, sample, loss_fn, target, warmup=args.warmup, repeats=args.repeats,
                progress=progress, name=model_ref.rpartition(":")[2],
            )
        elif model_ref in ZOO:
            graph = profile_spec(
                get_model(model_ref), args.batch_size, warmup=args.warmup,
                repeats=args.repeats, progress=progress,
            )
        else:
            raise ProfileError(
                f"unknown model {model_ref!r}: use a zoo model ({', '.join(sorted(ZOO))}) "
                "or path/to/file.py:function"
            )
    _print(graph)
    if args.output is not None:
        graph.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _show(args: argparse.Namespace) -> int:
    _print(load_graph(args.file))
    return 0


def _print(graph: LayerGraph) -> None:
    print(format_profile_summary(graph))
    print(format_profile_table(graph))


def _load_user_model(
    ref: str, batch_size: int | None
) -> tuple[nn.Module, Tensor, Callable[..., Tensor], Tensor | None]:
    """Import ``file.py`` and call ``function`` from ``file.py:function``."""
    from torch import Tensor, nn

    path_text, _, func_name = ref.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ProfileError(
            f"model file {path_text!r} does not exist; give path/to/file.py:function"
        )
    spec = importlib.util.spec_from_file_location(f"_dreampipe_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ProfileError(f"cannot import {path_text!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ProfileError(
            f"cannot import {path_text!r}: SyntaxError at line {exc.lineno}: {exc.msg}; "
            "fix the file"
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ProfileError(
            f"{path_text} has no function {func_name!r}; "
            "define one returning (model, sample_input, loss_fn[, target])"
        )
    if batch_size is not None and not _takes_batch_size(func):
        raise ProfileError(
            f"{ref} takes no batch_size argument but --batch-size {batch_size} was given; "
            "add a batch_size parameter or drop --batch-size"
        )
    result = func() if batch_size is None else func(batch_size=batch_size)
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ProfileError(
            f"{ref} returned {type(result).__name__}; it must return "
            "(model, sample_input, loss_fn) or (model, sample_input, loss_fn, target)"
        )
    model, sample, loss_fn = result[:3]
    target = result[3] if len(result) == 4 else None
    if not isinstance(model, nn.Module) or not isinstance(sample, Tensor) or not callable(loss_fn):
        raise ProfileError(
            f"{ref} returned ({type(model).__name__}, {type(sample).__name__}, "
            f"{type(loss_fn).__name__}, ...); expected (nn.Module, Tensor, callable, ...)"
        )
    if target is not None and not isinstance(target, Tensor):
        raise ProfileError(f"{ref} returned a {type(target).__name__} target; expected a Tensor")
    return model, sample, loss_fn, target


def _takes_batch_size(func: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to check: let the call decide
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "batch_size" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )
