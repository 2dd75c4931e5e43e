"""Load test of ``flashspec serve``: throughput and latency at 1, 4, 16 and 32 concurrent clients.

    python benchmarks/load_server.py                       # demo pair, the three modes
    python benchmarks/load_server.py --requests 16 --max-tokens 64
    python benchmarks/load_server.py --modes continuous static --concurrency 16 32
    python benchmarks/load_server.py --url http://127.0.0.1:8000 --api-key KEY   # a running one

Without ``--url`` the script loads the engine once and serves it in-process in three modes:
``continuous`` (``--max-batch``, default 16, requests join the running batch between rounds),
``static`` (the same ``--max-batch``, requests wait for the next batch) and ``unbatched``
(max_batch 1). At each level every mode runs once, in an order that rotates from level to
level. Each client sends ``--requests`` streaming greedy completions one after another
(HumanEval prompts; the k-th requests of the clients carry consecutive prompts, so requests in
flight together differ: identical prompts side by side would measure static batching's
sharing of a prompt read, ``share_prompts``, rather than batching); a request's latency runs
from sending it to its last byte, its time to first token to the first chunk with text.
Throughput is completion tokens (the server's usage counts) and requests per second of wall
time over the whole level. The clients are threads of the same process as an in-process
server, so they share its GIL (their work is small: socket reads and a JSON parse per chunk).

The engine is built as ``flashspec serve`` builds it (``--compile auto``: the compiled path, its
graphs for up to ``--max-batch`` rows compiled before the first request); ``--compile on off``
loads one engine of each and runs every mode on both at each level, interleaved, so compiled
batches can be compared with eager ones (``compiled_over_eager_tokens_per_s``).

Writes ``benchmarks/results/serve_load.json`` (or ``--out``: machine, versions and git sha from
``flashspec.bench.machine_info``; one entry per level and mode, with its ``mode``, ``batching``
and ``max_batch``; each batched mode's tokens/s over unbatched's) and prints a table. Not a
test: numbers depend on the load.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from flashspec.bench import humaneval_prompts, machine_info, write_json

DEFAULT_OUT = Path("benchmarks") / "results" / "serve_load.json"
# mode -> the server's batching, and whether it uses --max-batch (else 1 row at a time).
MODES: dict[str, tuple[Literal["continuous", "static"], bool]] = {
    "continuous": ("continuous", True),
    "static": ("static", True),
    "unbatched": ("static", False),
}


def one_request(
    host: str,
    port: int,
    prompt: str,
    max_tokens: int,
    api_key: str | None,
    headers: Sequence[str] = (),
) -> dict[str, Any]:
    """One streaming greedy completion; its latency, time to first token and token count, and
    with ``headers`` also ``"headers"``: those response headers' values (None where absent)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = {"Content-Type": "application/json"}
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    connection = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    seen: dict[str, str | None] = {}
    try:
        connection.request("POST", "/v1/completions", json.dumps(body).encode(), sent)
        response = connection.getresponse()
        seen = {name: response.getheader(name) for name in headers}
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: ") :])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']['message']}")
            if first is None and any(c.get("text") for c in data.get("choices", [])):
                first = time.perf_counter()
            if data.get("usage"):
                tokens = int(data["usage"]["completion_tokens"])
    finally:
        connection.close()
    end = time.perf_counter()
    result: dict[str, Any] = {
        "latency": end - start,
        "ttft": (first or end) - start,
        "tokens": tokens,
    }
    if headers:
        result["headers"] = seen
    return result


def run_level(
    host: str,
    port: int,
    clients: int,
    requests: int,
    prompts: list[str],
    max_tokens: list[int],
    api_key: str | None,
    headers: Sequence[str] = (),
) -> dict[str, Any]:
    """``clients`` threads, each sending ``requests`` requests back to back; request k of client
    i sends prompt ``(k * clients + i) % len(prompts)`` and asks for
    ``max_tokens[(i + k) % len(max_tokens)]`` tokens. With ``headers``, the result
    also counts each of those response headers' values over the answered requests that sent
    it (``"headers_seen"``: {name: {value: requests}})."""
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for k in range(requests):
            prompt = prompts[(k * clients + index) % len(prompts)]
            budget = max_tokens[(index + k) % len(max_tokens)]
            try:
                got = one_request(host, port, prompt, budget, api_key, headers)
            except (OSError, RuntimeError) as exc:
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    latency = np.array([r["latency"] for r in results])
    ttft = np.array([r["ttft"] for r in results])
    tokens = int(sum(r["tokens"] for r in results))

    def summary(values: np.ndarray) -> dict[str, float]:
        if values.size == 0:
            return {}
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {
            "p50": round(float(p50), 4),
            "p90": round(float(p90), 4),
            "p99": round(float(p99), 4),
            "mean": round(float(values.mean()), 4),
        }

    row: dict[str, Any] = {
        "clients": clients,
        "requests": len(results),
        "errors": errors[:5],
        "error_count": len(errors),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "latency_s": summary(latency),
        "ttft_s": summary(ttft),
    }
    if headers:
        row["headers_seen"] = {
            name: dict(Counter(r["headers"][name] for r in results if r["headers"][name]))
            for name in headers
        }
    return row


def run_server(
    label: str,
    host: str,
    port: int,
    args: argparse.Namespace,
    prompts: list[str],
    clients: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One concurrency level against one server (after one warm-up request)."""
    one_request(host, port, prompts[0], 4, args.api_key)
    row = {"mode": label, **extra}
    row.update(
        run_level(host, port, clients, args.requests, prompts, args.max_tokens, args.api_key)
    )
    print(
        f"{label:>10} clients {clients:>2}: {row['tokens_per_s']:8.1f} tok/s "
        f"{row['requests_per_s']:6.2f} req/s  latency p50 {row['latency_s'].get('p50', 0):.2f}"
        f" p90 {row['latency_s'].get('p90', 0):.2f} p99 {row['latency_s'].get('p99', 0):.2f}"
        f"  ttft p50 {row['ttft_s'].get('p50', 0):.2f} s"
        + (f"  ({row['error_count']} errors)" if row["error_count"] else ""),
        file=sys.stderr,
        flush=True,
    )
    return row


def speedups(rows: list[dict[str, Any]], levels: list[int]) -> dict[str, dict[str, float]]:
    """Each batched mode's tokens/s over unbatched's at the same level and compile setting:
    {label: {clients: x}} (a label is the mode, with ``/compiled`` or ``/eager`` after it when
    both ran)."""
    out: dict[str, dict[str, float]] = {}
    for clients in levels:
        by_label = {r["label"]: r for r in rows if r["clients"] == clients}
        for label, row in by_label.items():
            mode, _, suffix = label.partition("/")
            if mode == "unbatched":
                continue
            base = by_label.get("/".join(filter(None, ("unbatched", suffix))), {})
            if base.get("tokens_per_s"):
                ratio = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
                out.setdefault(label, {})[str(clients)] = ratio
    return out


def compiled_over_eager(
    rows: list[dict[str, Any]], levels: list[int]
) -> dict[str, dict[str, float]]:
    """Each mode's tokens/s with the compiled path over its tokens/s eager, at the same level:
    {mode: {clients: x}} (empty unless both ran)."""
    out: dict[str, dict[str, float]] = {}
    for clients in levels:
        at = {(r["mode"], r["compiled"]): r for r in rows if r["clients"] == clients}
        for (mode, compiled), row in at.items():
            eager = at.get((mode, False))
            if compiled and eager and eager["tokens_per_s"]:
                ratio = round(row["tokens_per_s"] / eager["tokens_per_s"], 2)
                out.setdefault(mode, {})[str(clients)] = ratio
    return out


def build_engine(args: argparse.Namespace, compile_setting: str) -> Any:
    """The engine ``flashspec serve`` would build for these flags (``--compile`` as given), its
    graphs compiled before it serves when the compiled path is on, as the server does."""
    from flashspec.flags.options import EngineOptions

    options = EngineOptions(target=args.target or "demo", draft=args.draft, compile=compile_setting)
    engine = options.build(long_lived=True)
    if engine.compiled.on:
        seconds = engine.warm_up(args.max_batch, freeze=True)
        print(f"compile {compile_setting}: compiled in {seconds:.0f} s", file=sys.stderr)
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="load a running server instead")
    parser.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    parser.add_argument("--target", default=None, help="in-process: target (default: demo)")
    parser.add_argument("--draft", default=None, help="in-process: draft model")
    parser.add_argument("--requests", type=int, default=8, help="requests per client (8)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        nargs="+",
        default=[32],
        help="tokens per request (32); several values: request k of client i asks for the "
        "(i + k)-th, cycling (mixed lengths, where a static batch waits for its longest row)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="in-process: the server modes to compare (all three)",
    )
    parser.add_argument("--max-batch", type=int, default=16, help="batched modes' max_batch")
    parser.add_argument("--prompts", type=int, default=164, help="HumanEval prompts to cycle")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: as flashspec serve)"
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        choices=["auto", "on", "off"],
        default=["auto"],
        help="in-process: the compiled path, as flashspec serve takes it (auto: on in a "
        "server); several values: an engine of each, every mode run on each",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"({DEFAULT_OUT})")
    args = parser.parse_args(argv)

    machine = machine_info()  # before the runs: it records the load average at the start
    prompts = [p.text for p in humaneval_prompts(limit=args.prompts)]
    settings = {
        key: value
        for key, value in vars(args).items()
        if key not in ("api_key", "out") and value is not None
    }
    settings["prompt_order"] = "distinct"  # requests in flight together carry different prompts
    rows: list[dict[str, Any]] = []
    if args.url is not None:
        parsed = urllib.parse.urlsplit(args.url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
        for clients in args.concurrency:
            extra = {"url": args.url, "label": "url", "compiled": None}
            rows.append(run_server("url", host, port, args, prompts, clients, extra))
    else:
        import torch

        from flashspec.serve import ServerThread, create_app
        from flashspec.serve.threads import apply_serving_threads

        # The threads flashspec serve would run (one core left to the event loop on a CPU).
        print(apply_serving_threads(args.threads, "cpu"), file=sys.stderr)
        settings["torch_threads"] = torch.get_num_threads()
        settings_list = list(dict.fromkeys(args.compile))
        engines = [(setting, build_engine(args, setting)) for setting in settings_list]
        # One engine, one server at a time (an engine has one worker). The runs' order
        # rotates per level, so drift in the machine's load does not always hit the same one.
        modes = list(dict.fromkeys(args.modes))
        runs = [(label, setting, engine) for setting, engine in engines for label in modes]
        for level, clients in enumerate(args.concurrency):
            shift = level % len(runs)
            for mode, setting, engine in runs[shift:] + runs[:shift]:
                batching, batched = MODES[mode]
                max_batch = args.max_batch if batched else 1
                compiled = bool(engine.compiled.on)
                path = "compiled" if compiled else "eager"
                label = mode if len(engines) == 1 else f"{mode}/{path}"
                app = create_app(
                    engine,
                    model_name="load",
                    max_batch=max_batch,
                    max_queue=1024,
                    timeout_s=3600,
                    batching=batching,
                )
                extra = {
                    "mode": mode,
                    "label": label,
                    "batching": batching,
                    "max_batch": max_batch,
                    "compile": setting,
                    "compiled": compiled,
                }
                with ServerThread(app) as server:
                    rows.append(
                        run_server(label, server.host, server.port, args, prompts, clients, extra)
                    )

    speedup = speedups(rows, args.concurrency)
    for label, by_clients in speedup.items():
        print(f"{label}/unbatched tokens/s by clients: {by_clients}", file=sys.stderr)
    data = {
        "benchmark": "serve_load",
        "machine": machine,
        "settings": settings,
        "runs": rows,
        "speedup_tokens_per_s": speedup,
        "compiled_over_eager_tokens_per_s": compiled_over_eager(rows, args.concurrency),
        # The earlier file's key: "batched" was static batching.
        "batched_speedup_tokens_per_s": speedup.get("static", {}),
    }
    write_json(data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
