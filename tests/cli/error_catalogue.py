"""The catalogue of bad inputs: each case, the command that hits it, and the one line it prints.

``tests/cli/test_error_catalogue.py`` runs every case and checks it exits 2
with one specific line before any worker starts; ``docs/errors.md`` is
generated from the same cases, so it cannot drift::

    python tests/cli/error_catalogue.py          # rewrite docs/errors.md
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CASES", "Case", "Outcome", "render", "run_case"]

_DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
_NODE = ("node{i} -- {desc} -- forward_compute_time={f}, backward_compute_time=2.0, "
         "activation_size=100.0, parameter_size=80.0\n")


def _graph_txt(*, forwards: tuple[float, ...] = (0.0, 1.0, 1.0), extra_nodes: str = "",
               extra_edges: str = "") -> str:
    """A 3-node PipeDream graph.txt (Input, two Linears) with optional additions."""
    descs = ("Input0", "Linear(4, 4)", "Linear(4, 4)")
    nodes = "".join(_NODE.format(i=i + 1, desc=d, f=f) for i, (d, f) in
                    enumerate(zip(descs, forwards, strict=True)))
    return nodes + extra_nodes + "\tnode1 -- node2\n\tnode2 -- node3\n" + extra_edges


def _profile_json(forward_ms: float = 1.0, *, scale: float = 1.0) -> str:
    """Our JSON profile of a 4-layer chain, every time x ``scale``; layer ``l2`` then gets
    ``forward_ms`` written straight into the JSON (``inf`` as the token ``Infinity``)."""
    from dreampipe.profiling.graph import Layer, LayerGraph

    layers = [Layer(f"l{i}", scale, 2.0 * scale, 1000, 1000) for i in range(4)]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "p.json"
        LayerGraph.chain(layers, batch_size=8).save(path)
        data = json.loads(path.read_text())
    data["layers"][2]["forward_ms"] = forward_ms
    return json.dumps(data)


def _plan_json(layers: int, model: str) -> str:
    """A 2-stage straight plan of ``layers`` layers for ``model`` (as ``plan -o`` saves it)."""
    from dreampipe.planning.plan import Plan

    return json.dumps(Plan.from_config(layers, [0, layers // 2], [1, 1], model=model).to_dict())


def _eight_stage_plan_json(virtual_stages: int) -> str:
    """A plan of 8 one-layer stages for topology 4: 2 to a worker, or (1) on 8 ranks
    without the ``virtual_stages`` field, as plan files were once saved."""
    from dreampipe.planning.plan import Plan

    data = Plan.from_config(8, list(range(8)), [1] * 8, topology="4",
                            virtual_stages=virtual_stages).to_dict()
    if virtual_stages == 1:
        del data["virtual_stages"]
    return json.dumps(data)


def _zbv_csv() -> str:
    """zbv of 8 stages on 4 ranks (2 a rank in a V), one microbatch, as PyTorch's CSV."""
    from dreampipe.scheduling.actions import ScheduleKind
    from dreampipe.scheduling.build import build_schedule
    from dreampipe.scheduling.torch_csv_write import torch_csv

    return torch_csv(build_schedule([1] * 8, ScheduleKind.ZBV, 1, 1, virtual_stages=2))


@dataclass(frozen=True)
class Case:
    """One bad input: ``argv`` for ``dreampipe`` (``{dir}`` is a scratch folder holding
    ``files``), and words its one-line error must contain."""

    id: str
    area: str
    what: str
    argv: tuple[str, ...]
    needles: tuple[str, ...]
    files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What a case printed: exit code, standard output, standard error ({dir} put back)."""

    code: int
    out: str
    err: str


def run_case(case: Case, main: Callable[[list[str]], int]) -> Outcome:
    """Run ``case`` through ``main`` in this process, in a fresh scratch folder."""
    with tempfile.TemporaryDirectory() as scratch:
        for name, text in case.files:
            path = Path(scratch) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        argv = [a.replace("{dir}", scratch) for a in case.argv]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        return Outcome(code, out.getvalue().replace(scratch, "{dir}"),
                       err.getvalue().replace(scratch, "{dir}"))


_G = ("g.txt", _graph_txt())
_P = ("p.json", _profile_json())
_PLAN = '{"format": "dreampipe.plan"'

CASES: tuple[Case, ...] = (
    # ---- profiles ----------------------------------------------------------------
    Case("graph-cycle", "profile", "a graph.txt whose edges form a cycle",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("cycle", "node2", "node3"),
         (("g.txt", _graph_txt(extra_edges="\tnode3 -- node2\n")),)),
    Case("graph-duplicate", "profile", "a graph.txt that names a node twice",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("'node2'", "twice"),
         (("g.txt", _graph_txt(extra_nodes=_NODE.format(i=2, desc="ReLU", f=1.0))),)),
    Case("graph-negative", "profile", "a graph.txt with a negative time",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("line 2", "forward_ms=-1.0"),
         (("g.txt", _graph_txt(forwards=(0.0, -1.0, 1.0))),)),
    Case("graph-empty", "profile", "an empty graph.txt",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("no node lines",),
         (("g.txt", ""),)),
    Case("graph-garbage", "profile", "a graph.txt line that is neither node nor edge",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("line 1", "'garbage'"),
         (("g.txt", "garbage\n"),)),
    Case("graph-dangling", "profile", "an edge to a node that does not exist",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s"), ("'node9'", "unknown"),
         (("g.txt", _graph_txt(extra_edges="\tnode1 -- node9\n")),)),
    Case("profile-infinite", "profile", "a JSON profile with an infinite time",
         ("plan", "{dir}/p.json", "-t", "2", "-b", "1GB/s"), ("inf",),
         (("p.json", _profile_json(float("inf"))),)),
    Case("profile-zero", "profile", "a profile whose every time is zero",
         ("plan", "{dir}/p.json", "-t", "2", "-b", "1GB/s"), ("0 ms", "profile the model again"),
         (("p.json", _profile_json(0.0, scale=0.0)),)),
    Case("profile-missing", "profile", "a profile path that does not exist",
         ("plan", "{dir}/nothing.json", "-t", "2", "-b", "1GB/s"), ("nothing.json",)),
    Case("profile-bundled-unknown", "profile", "a bundled profile name that does not exist",
         ("plan", "pipedream:nope", "-t", "2", "-b", "1GB/s"),
         ("'pipedream:nope'", "pipedream:vgg16", "show --list")),
    Case("profile-not-json", "profile", "a .json profile that is not JSON",
         ("show", "{dir}/p.json"), ("p.json", "not valid JSON"), (("p.json", "{not json"),)),
    Case("profile-gpt-unknown-key", "profile", "a profile by shape with a key it does not have",
         ("plan", "gpt:layers=2,hidden=64,heads=4,seq=8,vocab=10,width=3", "-t", "dgx-a100:1"),
         ("'width'", "the keys are layers")),
    Case("profile-gpt-missing-key", "profile", "a profile by shape without its vocabulary",
         ("plan", "gpt:layers=2,hidden=64,heads=4,seq=8", "-t", "dgx-a100:1"),
         ("misses vocab",)),
    Case("profile-gpt-heads", "profile", "a profile by shape whose heads do not divide its width",
         ("plan", "gpt:layers=2,hidden=64,heads=5,seq=8,vocab=10", "-t", "dgx-a100:1"),
         ("heads=5 does not divide hidden=64", "4 or 8")),
    Case("profile-gpt-no-device", "profile", "a profile by shape on a cluster without a device",
         ("plan", "gpt:layers=2,hidden=64,heads=4,seq=8,vocab=10", "-t", "4x4"),
         ("names no device", "dgx-a100:N")),
    # ---- topologies ---------------------------------------------------------------
    Case("bandwidth-no-unit", "topology", "a bandwidth without a unit",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "10"), ("'10'", "no unit"), (_G,)),
    Case("bandwidth-overflow", "topology", "a bandwidth too large to be a number",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1e400GB/s"), ("'1e400GB/s'", "finite"),
         (_G,)),
    Case("bandwidth-one-for-two-levels", "topology", "one bandwidth for a two-level cluster",
         ("plan", "{dir}/g.txt", "-t", "4x4", "-b", "10GB/s"), ("2 levels", "got 1"), (_G,)),
    Case("topology-zero", "topology", "a cluster shape with zero workers",
         ("plan", "{dir}/g.txt", "-t", "0x4"), ("0x4",), (_G,)),
    Case("topology-unknown", "topology", "a cluster name that is neither preset nor shape",
         ("plan", "{dir}/g.txt", "-t", "cluster-z"), ("cluster-z",), (_G,)),
    Case("topology-servers-count", "topology", "servers without a whole number of them",
         ("plan", "{dir}/g.txt", "-t", "dgx-a100:0"), ("'0'", "dgx-a100:2"), (_G,)),
    Case("memory-unreadable", "topology", "a memory size that is not a size",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s", "--memory", "lots"), ("'lots'",),
         (_G,)),
    Case("memory-no-unit", "topology", "a memory size without a unit",
         ("plan", "{dir}/g.txt", "-t", "2", "-b", "1GB/s", "--memory", "80"),
         ("'80'", "no unit", "80GB"), (_G,)),
    # ---- plans and simulation ------------------------------------------------------
    Case("plan-not-json", "plan", "a plan file that is not JSON",
         ("simulate", "{dir}/plan.json"), ("plan.json",), (("plan.json", _PLAN),)),
    Case("plan-wrong-profile", "plan", "a plan simulated with another model's profile",
         ("simulate", "{dir}/plan.json", "--profile", "{dir}/g.txt"), ("layers",),
         (_G, ("plan.json", _plan_json(9, "other"))),),
    Case("simulate-no-minibatches", "plan", "zero minibatches to simulate",
         ("simulate", "{dir}/p.json", "--minibatches", "0"), ("--minibatches",), (_P,)),
    Case("simulate-no-microbatches", "plan", "zero microbatches per minibatch",
         ("simulate", "{dir}/p.json", "--schedule", "gpipe", "--microbatches", "0"),
         ("--microbatches",), (_P,)),
    Case("simulate-virtual-stages", "plan", "virtual stages with a schedule that runs one "
         "stage per worker", ("simulate", "{dir}/p.json", "--virtual-stages", "2"),
         ("--virtual-stages 2", "only interleaved-1f1b"), (_P,)),
    Case("plan-virtual-stages-contradicted", "plan", "--virtual-stages other than the plan's",
         ("simulate", "{dir}/plan.json", "--schedule", "interleaved-1f1b", "--virtual-stages",
          "1"), ("--virtual-stages 1", "runs 2 stages per worker", "drop --virtual-stages 1"),
         (("plan.json", _eight_stage_plan_json(2)),)),
    Case("plan-virtual-stages-schedule", "plan", "a plan of 2 stages per worker under a "
         "schedule of one", ("simulate", "{dir}/plan.json"),
         ("--schedule pipedream", "use --schedule interleaved-1f1b"),
         (("plan.json", _eight_stage_plan_json(2)),)),
    Case("plan-ranks-past-topology", "plan", "a plan of more ranks than its topology's workers",
         ("simulate", "{dir}/plan.json", "--schedule", "interleaved-1f1b"),
         ("needs 8 workers", "topology 4 has 4", "dreampipe plan --virtual-stages 2"),
         (("plan.json", _eight_stage_plan_json(1)),)),
    Case("schedule-file-bad-action", "plan", "a PyTorch schedule file with a cell that is "
         "not an action", ("simulate", "{dir}/plan.json", "--schedule-file", "{dir}/pp.csv"),
         ("pp.csv:2: cell 2 '1X0'", "write e.g. 0F1"),
         (("plan.json", _plan_json(4, "m")), ("pp.csv", "0F0,0B0\n1F0,1X0\n"))),
    Case("schedule-file-v-placement", "plan", "a PyTorch schedule file of the V placement "
         "(ScheduleZBVZeroBubble's) on a plan of the loop", ("simulate", "{dir}/plan.json",
                                                            "--schedule-file", "{dir}/pp.csv"),
         ("places its 8 stages in the v placement, the plan in the loop",
          "dreampipe plan --schedule zbv"),
         (("plan.json", _eight_stage_plan_json(2)), ("pp.csv", _zbv_csv()))),
    Case("schedule-file-other-stages", "plan", "a PyTorch schedule file of other stages than "
         "the plan's", ("simulate", "{dir}/plan.json", "--schedule-file", "{dir}/pp.csv"),
         ("runs 1 unreplicated stages", "replicas 1-1"),
         (("plan.json", _plan_json(4, "m")), ("pp.csv", "0F0,0B0\n"))),
    Case("timeline-unwritable", "plan", "a timeline path inside a file",
         ("simulate", "{dir}/p.json", "--timeline", "{dir}/p.json/t.png"), ("t.png",), (_P,)),
    # ---- training -----------------------------------------------------------------
    Case("train-config-workers", "train", "--config that does not match --workers",
         ("train", "mlp", "--config", "2-1", "--workers", "2"), ("2-1", "3 workers"),),
    Case("train-no-steps", "train", "zero steps",
         ("train", "mlp", "--steps", "0"), ("steps",)),
    Case("train-microbatches-divide", "train", "microbatches that do not divide the batch",
         ("train", "mlp", "--schedule", "1f1b-flush", "--batch-size", "32",
          "--microbatches", "3"), ("3", "32")),
    Case("train-2bw-microbatches", "train", "2bw with too few microbatches for two versions",
         ("train", "mlp", "--workers", "3", "--schedule", "2bw", "--microbatches", "1"),
         ("2bw", "microbatches")),
    Case("train-pipedream-microbatches", "train", "microbatches with the pipedream schedule",
         ("train", "mlp", "--microbatches", "4"), ("pipedream",)),
    Case("train-unknown-model", "train", "a model the zoo does not have",
         ("train", "nosuchmodel"), ("nosuchmodel",)),
    Case("train-model-arg", "train", "a --model-arg without '='",
         ("train", "mlp", "--model-arg", "layers"), ("layers",)),
    Case("train-timeout", "train", "a negative timeout",
         ("train", "mlp", "--timeout", "-1"), ("timeout",)),
    Case("train-skip-pipedream", "train", "skipping non-finite minibatches under pipedream",
         ("train", "mlp", "--on-nonfinite", "skip"),
         ("--on-nonfinite skip", "every schedule but pipedream")),
    Case("train-fp16-async", "train", "fp16's shared loss scale under an asynchronous schedule",
         ("train", "mlp", "--precision", "fp16-mixed"), ("fp16-mixed", "synchronous")),
    Case("train-recompute-no-blocks", "train", "recomputing blocks of a model without any",
         ("train", "mlp", "--recompute-blocks", "1"), ("block",)),
    Case("train-zero-3-async", "train", "ZeRO level 3 with an asynchronous schedule",
         ("train", "mlp", "--zero", "3", "--schedule", "pipedream"),
         ("zero=3", "--schedule pipedream", "use zero=2")),
    Case("train-semantics-contradicted", "train", "a named schedule beside the other "
         "semantics", ("train", "mlp", "--schedule", "pipedream", "--semantics", "sync"),
         ("--schedule pipedream is asynchronous", "--semantics sync", "drop one of them")),
    Case("train-stages-range", "train", "a stage that starts past the last layer",
         ("train", "mlp", "--stages", "0,99"), ("99",)),
    Case("train-mnist-missing", "train", "MNIST from a folder without it",
         ("train", "mlp", "--dataset", "mnist", "--data-dir", "{dir}/none"), ("none",)),
    Case("train-trace-unwritable", "train", "a trace path inside a file",
         ("train", "mlp", "--trace", "{dir}/p.json/t.json"), ("t.json",), (_P,)),
    Case("train-plan-other-model", "train", "a plan made for another model",
         ("train", "mlp", "--plan", "{dir}/plan.json"), ("plan.json", "cnn"),
         (("plan.json", _plan_json(9, "cnn")),)),
    Case("train-profile-other-model", "train", "a saved profile of another model",
         ("train", "mlp", "--batch-size", "8", "--profile", "{dir}/p.json"),
         ("p.json", "4 layers", "OMP_NUM_THREADS=1 dreampipe profile mlp --batch-size 8"),
         (_P,)),
    Case("train-memory-stage", "train", "a forced partition whose stage does not fit --memory",
         ("train", "mlp", "--config", "straight", "--stages", "0,4", "--memory", "8MB"),
         ("--memory 8000000B", "stage 0 (layers 0..3) needs about", "raise the limit")),
    # ---- checkpoints --------------------------------------------------------------
    Case("resume-without-dir", "checkpoint", "--resume without a checkpoint folder",
         ("train", "mlp", "--resume"), ("--resume needs --checkpoint-dir",)),
    Case("every-without-dir", "checkpoint", "--checkpoint-every without a checkpoint folder",
         ("train", "mlp", "--checkpoint-every", "5"), ("--checkpoint-every 5 needs",)),
    Case("every-zero", "checkpoint", "a checkpoint every 0 updates",
         ("train", "mlp", "--checkpoint-dir", "{dir}/ck", "--checkpoint-every", "0"),
         ("--checkpoint-every 0",)),
    Case("resume-damaged", "checkpoint", "resuming from a checkpoint whose file was cut short",
         ("train", "mlp", "--checkpoint-dir", "{dir}/ck", "--resume"),
         ("ck/step-10 is damaged", ".metadata is 7 bytes", "100 bytes"),
         (("ck/step-10/.metadata", "partial"),
          ("ck/step-10/COMMITTED", '{"minibatches": 10, "files": {".metadata": 100}}'))),
    Case("resume-past-steps", "checkpoint", "resuming a run whose checkpoint is past --steps",
         ("train", "mlp", "--checkpoint-dir", "{dir}/ck", "--resume", "--steps", "5"),
         ("--steps 5", "at 10 minibatches"),
         (("ck/step-10/COMMITTED", '{"minibatches": 10, "files": {}}'),)),
)


def render(outcomes: dict[str, Outcome]) -> str:
    """``docs/errors.md``: every case by area, with its command and the line it prints."""
    lines = [
        "# Errors users can cause, and what dreampipe says",
        "",
        "Every case below exits with status 2 and prints one line naming the",
        "offending value and the fix, before any worker process starts.",
        "Generated from `tests/cli/error_catalogue.py` (`python tests/cli/error_catalogue.py`",
        "rewrites it; `tests/cli/test_error_catalogue.py` fails when it is stale).",
        "`{dir}` stands for the folder holding the bad file. The `Pipeline` API raises",
        "its own (a model it cannot split, a batch unlike the example, a loss that is not",
        "a scalar, a checkpoint from another model...) as exceptions before any send",
        "(a loss on a model the meta device cannot run: where the last stage makes it);",
        "`tests/api/test_pipeline_errors.py` checks each.",
    ]
    area = ""
    for case in CASES:
        if case.area != area:
            area = case.area
            lines += ["", f"## {area}", "", "| case | input | command | message |",
                      "| --- | --- | --- | --- |"]
        command = " ".join(("dreampipe", *case.argv)).replace("|", "\\|")
        message = outcomes[case.id].err.strip().replace("|", "\\|")
        lines.append(f"| `{case.id}` | {case.what} | `{command}` | {message} |")
    return "\n".join(lines) + "\n"


def _write_doc() -> None:
    from dreampipe.cli import main

    outcomes = {case.id: run_case(case, main) for case in CASES}
    _DOC.write_text(render(outcomes))
    print(f"wrote {_DOC} ({len(CASES)} cases)")


if __name__ == "__main__":
    sys.exit(_write_doc())
