"""Time to target over a shaped link: PipeDream's claim where data parallelism pays to sync.

``convergence.py`` runs its ranks over 127.0.0.1, where data parallelism's
all-reduce of the character transformer's 0.83M parameters is nearly free.
PipeDream's claim is about clusters where it is not. This study trains the
same runs (``convergence.py``'s workload, seeds and settings) with its two
ranks in two network namespaces joined by a veth pair that ``tc`` shapes to
``--rate`` each way (``tests/runtime/netns.py``), so every schedule pays for
what it sends at that rate: dp its gradients, the pipelines their
activations. The updates do not depend on the link, so the held-out figures
must equal the loopback study's epoch by epoch (``--report`` checks this);
only the seconds change.

    python benchmarks/convergence_link.py --rate 20MB/s   # as root: docs/convergence-link-*.json
    python benchmarks/convergence_link.py --report        # its section of docs/convergence.md

Needs root, ``ip netns`` and ``tc``. Each seed's runs (every schedule in turn)
share one pair of namespaces, removed with every process in them however the
run ends. ``--rate none`` runs over the unshaped veth pair.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence

from dreampipe.quantities import format_bytes, parse_bandwidth

__all__ = ["LINK", "main", "section"]

_ROOT = Path(__file__).resolve().parents[1]
#: The runs: the character transformer on 2 workers, long enough for 2bw's epochs.
LINK = convergence.Study(
    seeds=(0, 1, 2),
    groups=(convergence.Group(2, ("chars",), ("pipedream", "2bw", "1f1b-flush", "dp")),),
    epochs={"chars": 6}, steps={"chars": 30})
BEGIN = "<!-- link: written by `python benchmarks/convergence_link.py --report` -->"
END = "<!-- end of the link section -->"


def _netns() -> ModuleType:
    """``tests/runtime/netns.py``, loaded by path (the tests' helper, not a package)."""
    path = _ROOT / "tests" / "runtime" / "netns.py"
    spec = importlib.util.spec_from_file_location("_convergence_netns", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _slug(rate: str | None) -> str:
    return "none" if rate is None else re.sub(r"[^0-9A-Za-z]", "", rate.replace("/", "p"))


def results_path(rate: str | None) -> Path:
    """Where the runs at ``rate`` (None: unshaped) are kept."""
    return _ROOT / "docs" / f"convergence-link-{_slug(rate)}.json"


def _launch(ns: Any, pair: Any, results: Path, keys: list[str], limit_s: float) -> None:
    """Rank 0 and 1 of one seed's runs, one in each namespace (``ns``: the netns helper);
    a failure stops the study with rank 1's last output (rank 0's passes through)."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = [results.with_suffix(f".rank{r}.log") for r in (0, 1)]
    try:
        for rank in (0, 1):
            with logs[rank].open("wb") as log:
                procs.append(subprocess.Popen(
                    [*pair.exec_prefix(rank), sys.executable, __file__, "--worker",
                     "--results", str(results), "--keys", ",".join(keys)],
                    stdout=log if rank else None, stderr=subprocess.STDOUT if rank else None,
                    env=pair.rank_env(rank), start_new_session=True))
    finally:
        codes = ns.wait_ranks(procs, limit_s)
    if codes != [0, 0]:
        tail = logs[1].read_text(errors="replace")[-3000:]
        raise SystemExit(f"a rank failed or ran past {limit_s:.0f} s (exit codes {codes}); "
                         f"rank 1's output:\n{tail}")
    for log in logs:
        log.unlink(missing_ok=True)


def run(rate: str | None, limit_s: float) -> Path:
    """Every seed's runs at ``rate`` bytes/s each way (None: unshaped); the results file."""
    ns = _netns()
    reason = ns.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot shape a link here: {reason}")
    per_s = None if rate is None else parse_bandwidth(rate, require_unit=True)
    results = results_path(rate)
    data = convergence._load(results, LINK)
    if data.setdefault("link", rate) != rate:
        raise SystemExit(f"{results} holds runs at {data['link']}, not {rate}")
    convergence._save(results, data)
    for seed in LINK.seeds:
        todo = [k for k in LINK.keys(LINK.groups[0], seed)
                if k not in convergence._load(results, LINK)["runs"]]
        print(f"seed {seed} at {rate or 'an unshaped link'}: {len(todo)} runs to do",
              flush=True)
        if not todo:
            continue
        with ns.veth_pair(f"dpc{os.getpid() % 10**6}") as pair:
            pair.shape(per_s)
            _launch(ns, pair, results, todo, limit_s)
    return results


# ---- the report -------------------------------------------------------------------
def _rows(data: dict[str, Any], loopback: dict[str, Any], target: float) -> list[str]:
    """One row per schedule: seconds per epoch (median, min-max over seeds), epochs and
    seconds to ``target`` (medians), against dp's."""
    import statistics

    runs = data["runs"].values()
    reach: dict[str, tuple[float, float]] = {}
    rows = []
    for variant in LINK.groups[0].variants:
        mine = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["seed"])
        if not mine:
            continue
        _check_same_updates(mine, loopback)
        per = [r["seconds"][-1] / (len(r["seconds"]) - 1) for r in mine]
        hit = [convergence_report._to_target(r, convergence_report._LOSS, target)
               for r in mine]
        epochs = statistics.median(e for e, _ in hit)
        seconds = statistics.median(s for _, s in hit)
        reach[variant] = epochs, seconds
        rows.append((variant, per, hit, epochs, seconds))
    dp = reach.get("dp", (float("inf"), float("inf")))[1]
    out = []
    for variant, per, hit, epochs, seconds in rows:
        ratio = "-" if seconds == float("inf") or dp == float("inf") else f"{seconds / dp:.2f}"
        out.append(
            f"| {variant} | {statistics.median(per):.2f} ({min(per):.2f}-{max(per):.2f}) | "
            f"{sum(e != float('inf') for e, _ in hit)}/{len(hit)} | "
            f"{convergence_report._fmt(epochs)} | {convergence_report._fmt(seconds)} | "
            f"{ratio} |")
    return out


def _check_same_updates(runs: list[dict[str, Any]], loopback: dict[str, Any]) -> None:
    """The link changes the seconds, never the updates: every held-out loss equals the
    loopback study's run of the same key, epoch by epoch."""
    for run_ in runs:
        key = f"chars/{run_['variant']}/2/{run_['seed']}"
        other = loopback["runs"].get(key)
        if other is None:
            raise SystemExit(f"the loopback study has no run {key}")
        for epoch, (a, b) in enumerate(zip(run_["test_loss"], other["test_loss"],
                                           strict=False)):
            if abs(a - b) > 1e-4 * abs(b):
                raise SystemExit(f"{key} epoch {epoch}: held-out loss {a} over the link, "
                                 f"{b} on loopback; the link changed the updates")


def section(loopback: dict[str, Any], studies: list[dict[str, Any]]) -> str:
    """The markdown of every link study's rows, slowest rate last."""
    target = convergence_report.targets(loopback)["chars"]

    def rate_of(d: dict[str, Any]) -> float:
        return float("inf") if d["link"] is None else parse_bandwidth(d["link"])

    lines = [f"Character transformer, 2 workers, target {target:.4g} (the loopback study's): "
             "seconds per epoch (median, and the seeds' range), seeds at the target, epochs "
             "and training seconds to it (medians over the seeds), and those seconds over "
             "dp's at the same rate.", ""]
    for d in sorted(studies, key=rate_of, reverse=True):
        label = ("the unshaped veth pair" if d["link"] is None
                 else f"{d['link']} each way ({format_bytes(parse_bandwidth(d['link']))}/s)")
        lines += [f"**{label}**", "",
                  "| schedule | s per epoch | seeds at target | epochs to target | "
                  "seconds to target | / dp's |", "|---|---|---:|---:|---:|---:|",
                  *_rows(d, loopback, target), ""]
    return "\n".join(lines).rstrip() + "\n"


def _write_section(text: str, doc: Path) -> Path:
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{doc} has lost the link section's markers; put back {BEGIN!r} "
                         f"and {END!r}")
    head, rest = body.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")
    return doc


def link_studies(docs: Path) -> list[dict[str, Any]]:
    """Every link study's results in ``docs``."""
    return [json.loads(p.read_text()) for p in sorted(docs.glob("convergence-link-*.json"))]


import convergence_report  # noqa: E402  (beside this script)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", help="each way, with a unit (e.g. 20MB/s, 100Mbps); "
                                       "'none' runs over the unshaped veth pair")
    parser.add_argument("--report", action="store_true",
                        help="write the section of docs/convergence.md from every "
                             "docs/convergence-link-*.json; train nothing")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one seed's runs may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--keys", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        convergence._worker(LINK, args.results, args.keys.split(","))
        return
    if args.rate is None and not args.report:
        parser.error("give --rate RATE to train, or --report")
    if args.rate is not None:
        rate = None if args.rate == "none" else args.rate
        start = time.perf_counter()
        print(f"wrote {run(rate, args.timeout)} in {time.perf_counter() - start:.0f} s")
    docs = _ROOT / "docs"
    loopback = json.loads((docs / "convergence.json").read_text())
    print(f"wrote {_write_section(section(loopback, link_studies(docs)), docs / 'convergence.md')}")


if __name__ == "__main__":
    main()
