"""Load test of replicas: what ``flashspec serve --replicas`` buys on this machine.

    python benchmarks/load_replicas.py                     # demo pair, 16 clients, three modes
    python benchmarks/load_replicas.py --repeats 3         # three rounds, medians
    python benchmarks/load_replicas.py --modes process replicas-2 --max-tokens 16 64
    python benchmarks/load_replicas.py --quick --out /tmp/replicas-quick.json   # a smoke run

Three ways to serve the same engine (``--target``, default the demo pair, ``compile="off"``),
each with continuous batching and ``--max-batch`` rows per engine batch:

- ``process``: the single-process server (``flashspec.serve.create_app`` in a
  ``ServerThread`` of this process), torch on all of the machine's threads: what a user of
  ``flashspec serve`` already has;
- ``replicas-1``: ``flashspec.cluster.Cluster`` with one replica of one CPU (one torch
  thread) on a local Ray head started for the run;
- ``replicas-2``: the same with two replicas of one CPU each.

One mode runs at a time: its server is started (timed: ``startup_s``, from nothing to ready;
for the replicas modes this includes starting Ray, which is stopped again before the next
mode starts, as one process cannot hold two Ray sessions), warmed up with a few short requests,
then loaded by ``--clients`` client threads, each sending ``--requests`` streaming greedy
completions one after another (``load_server.run_level``: HumanEval prompts, in turn; latency
runs from sending a request to its last byte, time to first token to its first chunk with
text; throughput is completion tokens and requests per second of wall time). The clients
read each answer's ``x-flashspec-replica`` header, so a run records which replicas answered.

The clients are threads of this process. In the ``process`` mode they share the server's
process and GIL; in the replicas modes they share the machine's cores with Ray's proxy,
controller, ingress and replicas: what the replicas cost is in their numbers too.

With ``--repeats N`` every mode runs N times, the order of the modes rotating from round to
round (so drift in the machine's load does not always hit the same mode); the summary holds
each mode's medians over its rounds, and its tokens/s over ``process``'s and ``replicas-1``'s.

Writes ``benchmarks/results/replicas.json`` (or ``--out``: machine, versions incl. Ray's and
git sha from ``flashspec.bench.machine_info``; every round of every mode under ``runs``, the
medians under ``modes``) and prints a table. Not a test: numbers depend on the load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The sibling load test holds the client; run as a script, its folder is on sys.path already,
# imported (as a module, from elsewhere) it may not be.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_server import run_level

from flashspec.bench import humaneval_prompts, machine_info, write_json
from flashspec.cluster import REPLICA_HEADER
from flashspec.flags.options import EngineOptions

DEFAULT_OUT = Path("benchmarks") / "results" / "replicas.json"
MODES = ("process", "replicas-1", "replicas-2")
# mode -> engine replicas on Ray Serve (process: none, the engine runs in this process).
REPLICAS: dict[str, int] = {"process": 0, "replicas-1": 1, "replicas-2": 2}
# CPUs (and so torch threads) each replica reserves.
REPLICA_CPUS = 1
APP_NAME = "flashspec-load"
MODEL_NAME = "load"
# Limits no run should reach: a 503 or 504 would measure the limit, not the serving.
MAX_QUEUE = 1024
TIMEOUT_S = 3600.0
# Short concurrent requests before the timed ones, enough that every replica answers one
# (the router sends each to the less loaded of two replicas) and its first call is not timed.
WARM_UP_REQUESTS = 4
WARM_UP_TOKENS = 4
# --quick: a smoke run's defaults (explicit --requests/--max-tokens win).
QUICK_REQUESTS = 1
QUICK_MAX_TOKENS = [16]
FULL_REQUESTS = 4
FULL_MAX_TOKENS = [64]


@dataclass
class Served:
    """A server that is up: where it listens, how long it took to get there, what runs it."""

    host: str
    port: int
    startup_s: float
    torch_threads: int
    replicas_alive: list[str]


@contextlib.contextmanager
def process_server(options: EngineOptions, max_batch: int) -> Iterator[Served]:
    """The single-process server over a freshly built engine, torch on every core."""
    import torch

    from flashspec.serve import ServerThread, create_app

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    start = time.perf_counter()
    app = create_app(
        options.build(long_lived=True),
        model_name=MODEL_NAME,
        max_batch=max_batch,
        max_queue=MAX_QUEUE,
        timeout_s=TIMEOUT_S,
        batching="continuous",
    )
    with ServerThread(app) as server:
        yield Served(server.host, server.port, time.perf_counter() - start, threads, [])
    # The engine's memory should not linger into the next mode's run.
    del app
    gc.collect()


@contextlib.contextmanager
def cluster_server(options: EngineOptions, replicas: int, max_batch: int) -> Iterator[Served]:
    """``replicas`` engine replicas of one CPU each on a local Ray head, started here and
    stopped on exit (also when starting fails half way)."""
    from flashspec.cluster import Cluster, ClusterSettings

    settings = ClusterSettings(
        engine=options,
        replicas=replicas,
        replica_cpus=REPLICA_CPUS,
        model_name=MODEL_NAME,
        max_batch=max_batch,
        max_queue=MAX_QUEUE,
        timeout_s=TIMEOUT_S,
        app_name=APP_NAME,
    )
    # address="": a local head even where RAY_ADDRESS names a cluster; the question is what
    # replicas buy on this machine.
    cluster = Cluster(
        settings,
        host="127.0.0.1",
        port=0,
        address="",
        num_cpus=os.cpu_count(),
        log_to_driver=False,
    )
    start = time.perf_counter()
    try:
        cluster.start()
        startup = time.perf_counter() - start
        yield Served(cluster.host, cluster.port, startup, settings.threads, cluster.replicas())
    finally:
        cluster.stop()


def serving(mode: str, options: EngineOptions, max_batch: int) -> AbstractContextManager[Served]:
    """The context manager that runs ``mode``'s server."""
    if REPLICAS[mode] == 0:
        return process_server(options, max_batch)
    return cluster_server(options, REPLICAS[mode], max_batch)


def run_mode(
    mode: str,
    options: EngineOptions,
    args: argparse.Namespace,
    prompts: list[str],
    repeat: int,
) -> dict[str, Any]:
    """Start ``mode``'s server, warm it up, load it, stop it: one row of ``runs``."""
    with serving(mode, options, args.max_batch) as served:
        warm = run_level(
            served.host,
            served.port,
            WARM_UP_REQUESTS,
            1,
            prompts,
            [WARM_UP_TOKENS],
            None,
            (REPLICA_HEADER,),
        )
        level = run_level(
            served.host,
            served.port,
            args.clients,
            args.requests,
            prompts,
            args.max_tokens,
            None,
            (REPLICA_HEADER,),
        )
    seen = level.pop("headers_seen")[REPLICA_HEADER]
    row: dict[str, Any] = {
        "mode": mode,
        "repeat": repeat,
        "replicas": REPLICAS[mode],
        "torch_threads": served.torch_threads,
        "startup_s": round(served.startup_s, 2),
        "replicas_alive": served.replicas_alive,
        # Requests answered, by the replica that answered (the process mode sends no header).
        "replicas_seen": dict(sorted(seen.items())),
        "warm_up_replicas_seen": dict(sorted(warm["headers_seen"][REPLICA_HEADER].items())),
        "warm_up_errors": warm["error_count"],
        **level,
    }
    print(f"  {line(row)}", file=sys.stderr, flush=True)
    return row


def median(values: list[float]) -> float:
    """The median, rounded as ``run_level`` rounds."""
    return round(float(statistics.median(values)), 4)


def summarise(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds: medians of the rates, percentiles and startup; errors summed; every
    replica that answered in any round."""
    seen: dict[str, int] = {}
    for run in runs:
        for replica, count in run["replicas_seen"].items():
            seen[replica] = seen.get(replica, 0) + count

    def percentiles(key: str) -> dict[str, float]:
        names = [name for name in ("p50", "p90", "p99") if all(name in r[key] for r in runs)]
        return {name: median([r[key][name] for r in runs]) for name in names}

    return {
        "mode": mode,
        "replicas": REPLICAS[mode],
        "torch_threads": runs[0]["torch_threads"],
        "rounds": len(runs),
        "tokens_per_s": round(median([r["tokens_per_s"] for r in runs]), 2),
        "requests_per_s": round(median([r["requests_per_s"] for r in runs]), 3),
        "latency_s": percentiles("latency_s"),
        "ttft_s": percentiles("ttft_s"),
        "startup_s": round(median([r["startup_s"] for r in runs]), 2),
        "requests": sum(r["requests"] for r in runs),
        "error_count": sum(r["error_count"] for r in runs),
        "errors": [e for r in runs for e in r["errors"]][:5],
        "replicas_seen": dict(sorted(seen.items())),
    }


def add_ratios(summary: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each mode's median tokens/s over ``process``'s and ``replicas-1``'s (where they ran and
    served tokens), set on its summary as ``vs_process``/``vs_replicas_1`` and returned as
    {baseline: {mode: ratio}}."""
    by_mode = {s["mode"]: s["tokens_per_s"] for s in summary}
    ratios: dict[str, dict[str, float]] = {}
    for base in ("process", "replicas-1"):
        key = "vs_" + base.replace("-", "_")
        for entry in summary:
            ratio = round(entry["tokens_per_s"] / by_mode[base], 2) if by_mode.get(base) else None
            entry[key] = ratio
            if ratio is not None:
                ratios.setdefault(base, {})[entry["mode"]] = ratio
    return ratios


def line(row: dict[str, Any]) -> str:
    """One run or summary on one line, for stderr."""
    lat, ttft = row["latency_s"], row["ttft_s"]
    answered = ", ".join(f"{k}:{v}" for k, v in row["replicas_seen"].items()) or "-"
    return (
        f"{row['mode']:>10}: {row['tokens_per_s']:7.1f} tok/s {row['requests_per_s']:6.2f} "
        f"req/s  latency p50 {lat.get('p50', 0):.2f} p90 {lat.get('p90', 0):.2f} p99 "
        f"{lat.get('p99', 0):.2f}  ttft p50 {ttft.get('p50', 0):.2f} p99 {ttft.get('p99', 0):.2f}"
        f"  startup {row['startup_s']:.1f} s  errors {row['error_count']}  answered by "
        f"{answered}"
    )


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as a plain-text table."""
    head = (
        f"{'mode':>10} {'tok/s':>8} {'vs proc':>8} {'vs rep-1':>8} {'req/s':>7} "
        f"{'lat p50':>8} {'p90':>6} {'p99':>6} {'ttft p50':>9} {'p99':>6} {'start s':>8} "
        f"{'errors':>6}  replicas answering"
    )
    rows = [head]
    for s in summary:
        lat, ttft = s["latency_s"], s["ttft_s"]

        def ratio(key: str, s: dict[str, Any] = s) -> str:
            return f"{s[key]:.2f}x" if s.get(key) is not None else "-"

        rows.append(
            f"{s['mode']:>10} {s['tokens_per_s']:8.1f} {ratio('vs_process'):>8} "
            f"{ratio('vs_replicas_1'):>8} {s['requests_per_s']:7.2f} {lat.get('p50', 0):8.2f} "
            f"{lat.get('p90', 0):6.2f} {lat.get('p99', 0):6.2f} {ttft.get('p50', 0):9.2f} "
            f"{ttft.get('p99', 0):6.2f} {s['startup_s']:8.1f} {s['error_count']:6d}  "
            f"{len(s['replicas_seen']) or '-'}"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; ``--quick`` fills in the defaults not given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo", help="the engine's target (demo)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per client ({FULL_REQUESTS}; --quick: {QUICK_REQUESTS})",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"tokens per request ({FULL_MAX_TOKENS[0]}; --quick: {QUICK_MAX_TOKENS[0]}); "
        "several values: request k of client i asks for the (i + k)-th, cycling",
    )
    parser.add_argument("--max-batch", type=int, default=8, help="rows per engine batch (8)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="the modes to compare (all three)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every mode, order rotating (1)"
    )
    parser.add_argument("--prompts", type=int, default=32, help="HumanEval prompts to cycle")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few, short requests")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"({DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    if args.max_tokens is None:
        args.max_tokens = list(QUICK_MAX_TOKENS if args.quick else FULL_MAX_TOKENS)
    args.modes = list(dict.fromkeys(args.modes))
    for name in ("clients", "requests", "max_batch", "repeats", "prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    cpus = os.cpu_count() or 1
    # Checked before the first mode runs, not after the others have taken minutes.
    for mode in args.modes:
        if REPLICAS[mode] * REPLICA_CPUS > cpus:
            parser.error(
                f"{mode} needs {REPLICAS[mode] * REPLICA_CPUS} CPUs; this machine has {cpus}"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        ["python", "benchmarks/load_replicas.py", *(sys.argv[1:] if argv is None else argv)]
    )
    import ray

    machine = machine_info()  # before the runs: it records the load average at the start
    machine["ray"] = ray.__version__
    options = EngineOptions(target=args.target, compile="off")
    prompts = [p.text for p in humaneval_prompts(limit=args.prompts)]
    # ray.init without an address still joins $RAY_ADDRESS; a local head needs it unset.
    os.environ.pop("RAY_ADDRESS", None)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        shift = repeat % len(args.modes)
        order = args.modes[shift:] + args.modes[:shift]
        print(f"round {repeat + 1}/{args.repeats}: {', '.join(order)}", file=sys.stderr)
        for mode in order:
            runs.append(run_mode(mode, options, args, prompts, repeat))
    summary = [summarise(mode, [r for r in runs if r["mode"] == mode]) for mode in args.modes]
    ratios = add_ratios(summary)
    print(table(summary), file=sys.stderr)
    data = {
        "benchmark": "replicas",
        "machine": machine,
        "settings": {
            "command": command,
            "target": args.target,
            "compile": options.compile,
            "clients": args.clients,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "max_batch": args.max_batch,
            "batching": "continuous",
            "modes": args.modes,
            "repeats": args.repeats,
            "prompts": args.prompts,
            "quick": args.quick,
            "replica_cpus": REPLICA_CPUS,
            "process_threads": os.cpu_count(),
            "warm_up": {"requests": WARM_UP_REQUESTS, "max_tokens": WARM_UP_TOKENS},
        },
        "runs": runs,
        "modes": summary,
        "speedup_tokens_per_s": ratios,
    }
    write_json(data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
