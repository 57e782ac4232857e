"""`kv-offload bench gpu`: does a peer hit beat recomputing the prompt on this machine's GPU?

For each model (a shipped config, ``llama-3.1-8b``, ``llama-3.1-70b``, or a path to a
config.json; random weights) and prompt length it measures the recompute (prefill on the
device, ``prefill``) and the peer hit as a pod does it, with real holder and fetcher
sidecars on the chosen plane landing the prompt's chunks in vLLM-shaped rows and the rows
copied into a device KV cache (``peer``). Reported per length: recompute, the hit by
phase (lookup, fetch, host to device), its fixed cost before bytes move (the first chunk's
time from its request, sent with the lookup, to verified), the speedup, the fetch rate, the break-even link
rate (KV bytes / recompute time) and the sidecars' CPU-seconds per GB (``geometry``
holds the arithmetic). ``--lanes 1,2,4,8`` repeats the hit per lane count (the sidecars'
``--lanes``): the last count at every length, the others at ``--sweep-lengths`` only.
``--sidecar-cpus 1,2,4,8`` adds, per count, a pair whose holder and fetcher each run on that
many CPUs of their half with the lanes their own choice (one per core, as a pod's sidecar given
that CPU request): the CPU request a GPU pod's sidecar needs, at ``--sweep-lengths``.
Beside each lane count, raw TCP with as many streams, pinned as the sidecars are
(``raw_tcp``; the holder's side on the first half of the CPUs, the fetcher's on the
second, ``pinning``), and the issue's GPU targets where the run measured them
(``report``). Progress lines on stderr; a table, or with ``--json`` one JSON object, on
stdout (``--json PATH``: the JSON in a file, the table on stdout); a PNG.
The 70B's figures are one GPU's equivalent: recompute of all 80 layers (timed on 8, scaled)
against a hit of all its KV into one GPU; a TP8 pod divides the recompute by up to 8 over the
same bytes, so its break-even rate is up to 8 times the one reported.

Without CUDA the same code runs on the CPU (float32 prefill, CPU tensors for the KV cache,
no cudaHostRegister) with the tiny model and short prompts by default: a check of the
code, not a measurement (the tests run it so).

On the GPU machine (16 CPUs, one H200; python3 with torch and transformers), from the
repository root, after the carried wheels' install (it exports ``PYTHONPATH=/tmp/site``: the
sidecar needs ``cryptography``, absent there, and the sidecars inherit the path), about 4-6
minutes with these defaults (both models; 1K-48K tokens for recompute, the peer hits up to
--max-kv-gib 8 of KV, so 70B's up to 16K; lanes 1, 2 and 4 at 2K and 16K tokens, 8 lanes at
every length)::

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/sidecar:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}
    timeout 560 python3 -m kv_offload_operator.cli bench gpu --plane tcp --lanes 1,2,4,8 \\
        --json $OUT/bench-gpu.json --plot $OUT/bench-gpu.png 2>&1 | tee $OUT/bench-gpu.log

(The JSON is written after the prefill and after each pool, so a run cut short keeps what it
measured; ``--models llama-3.1-8b --lengths 2048,16384`` for a shorter run; ``--plane tls`` for
the same hits under mutual TLS 1.3, whose lanes each decrypt on a core of their own.) The CPU
request a GPU pod's sidecar needs, and the tcp/tls comparison, in one device call of an estimated
5-6 minutes (8B only; each plane's lanes and sidecar CPUs at every length)::

    for plane in tcp tls; do timeout 240 python3 -m kv_offload_operator.cli bench gpu \\
        --plane $plane --models llama-3.1-8b --lengths 1024,2048,4096,16384 \\
        --sweep-lengths 1024,2048,4096,16384 --lanes 1,2,4,8 --sidecar-cpus 1,2,4,8 \\
        --json $OUT/bench-gpu-$plane.json --plot $OUT/bench-gpu-$plane.png 2>&1 \\
        | tee $OUT/bench-gpu-$plane.log; done
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench.gpu.geometry import Geometry, breakeven_gbps, load_model_config, speedup
from kv_offload_tools.bench.gpu.peer import PeerSettings
from kv_offload_tools.bench.gpu.pinning import first_cpus, split_cpus
from kv_offload_tools.progress import timestamped

PLANES = ("tcp", "tls", "ucx", "nixl")
# Defaults on a GPU: the models and prompt lengths.
GPU_MODELS = ("llama-3.1-8b", "llama-3.1-70b")
GPU_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 49152)
# Defaults on a CPU: the tiny model, short prompts (a check of the code).
CPU_MODELS = ("tiny-llama",)
CPU_LENGTHS = (256, 512, 1024)
# Lengths at which lane counts other than the last are measured.
DEFAULT_SWEEP_LENGTHS = (2048, 16384)
# Tokens per chunk (vLLM's kv_connector_extra_config block_size): 16 MiB chunks for 8B.
DEFAULT_CHUNK_TOKENS = 128
# Largest KV (GiB) of a prompt whose peer hit is measured (its rows and both stores live in
# /dev/shm at once: three times this).
DEFAULT_MAX_KV_GIB = 8.0
# --json without a path: the report goes to stdout as JSON.
JSON_TO_STDOUT = "-"
# /dev/shm bytes a peer hit of B bytes needs: the rows, the holder's store, the fetcher's.
SHM_COPIES = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kv-offload bench gpu``."""
    parser.add_argument("--models", default="",
                        help="comma-separated models: shipped names (llama-3.1-8b, llama-3.1-70b, tiny-llama) "
                             f"or config.json paths (default {','.join(GPU_MODELS)} with CUDA, "
                             f"{','.join(CPU_MODELS)} without)")
    parser.add_argument("--lengths", default="",
                        help="comma-separated prompt lengths in tokens (default "
                             f"{','.join(map(str, GPU_LENGTHS))} with CUDA, {','.join(map(str, CPU_LENGTHS))} without)")
    parser.add_argument("--plane", choices=PLANES, default=PeerSettings.plane,
                        help="the sidecars' data plane (default %(default)s)")
    parser.add_argument("--lanes", default="",
                        help="comma-separated lane counts, each a pair of sidecars started with --lanes N "
                             "(default: one pair, the sidecars' own choice)")
    parser.add_argument("--sidecar-cpus", default="",
                        help="comma-separated core counts: per count one more pair of sidecars, the holder "
                             "and the fetcher each on the first that many CPUs of its half, lanes their own "
                             "choice (one per core), measured at --sweep-lengths (default: none)")
    parser.add_argument("--sweep-lengths", default=",".join(map(str, DEFAULT_SWEEP_LENGTHS)),
                        help="lengths at which the lane counts before the last are measured; those not in "
                             "--lengths are left out, and with none left the shortest and longest length "
                             "(default %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help="tokens per chunk, vLLM's block_size in kv_connector_extra_config, a multiple "
                             "of 16 (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=PeerSettings.repeats,
                        help="timed runs per length, after a warm-up; the median is reported (default %(default)s)")
    parser.add_argument("--max-kv-gib", type=float, default=DEFAULT_MAX_KV_GIB,
                        help="peer hits only for prompts with at most this much KV (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=PeerSettings.timeout_s,
                        help="seconds a lookup or a load may take (default %(default)s)")
    parser.add_argument("--shm-dir", default=PeerSettings.shm_dir,
                        help="folder of the rows' file, vLLM's region; the sidecars' stores are in their "
                             "pool's folder under /dev/shm (default %(default)s)")
    parser.add_argument("--json", nargs="?", const=JSON_TO_STDOUT, default="", metavar="PATH",
                        help="print one JSON object instead of the table; with PATH, write it there "
                             "(after the prefill and each pool) and print the table")
    parser.add_argument("--plot", default="kv-offload-bench-gpu.png",
                        help="PNG written with the results (default %(default)s; '' for none)")


def _usage(message: str) -> UsageError:
    return UsageError(f"kv-offload bench gpu: {message}")


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _usage(f"--{flag} {text!r} must be comma-separated integers") from None
    if any(v < 1 for v in values):
        raise _usage(f"--{flag} {text!r}: each value must be at least 1")
    return values


def sweep_lengths(lengths: Sequence[int], asked: Sequence[int]) -> list[int]:
    """The lengths lane counts before the last are measured at (see ``--sweep-lengths``)."""
    chosen = [n for n in lengths if n in asked]
    return chosen or sorted({min(lengths), max(lengths)})


def parse(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """The run's plan from its flags (device-dependent defaults filled in)."""
    models = [m.strip() for m in str(args.models).split(",") if m.strip()] or list(GPU_MODELS if cuda else CPU_MODELS)
    lengths = sorted(set(_ints("lengths", args.lengths))) or list(GPU_LENGTHS if cuda else CPU_LENGTHS)
    lanes: list[int | None] = list(_ints("lanes", args.lanes)) or [None]
    halves = split_cpus(os.sched_getaffinity(0))
    sidecar_cpus = []
    for count in _ints("sidecar-cpus", args.sidecar_cpus):
        try:
            sidecar_cpus.append((count, first_cpus(halves, count)))
        except ValueError as exc:
            raise _usage(f"--sidecar-cpus {args.sidecar_cpus!r}: {exc}") from None
    if args.chunk_tokens < 16 or args.chunk_tokens % 16:
        raise _usage(f"--chunk-tokens {args.chunk_tokens} must be a positive multiple of 16 (vLLM's block)")
    if lengths[0] < args.chunk_tokens:
        raise _usage(f"--lengths: {lengths[0]} tokens is less than one chunk ({args.chunk_tokens} tokens)")
    if args.repeats < 1 or args.timeout_s <= 0 or args.max_kv_gib <= 0:
        raise _usage("--repeats must be >= 1, --timeout-s and --max-kv-gib > 0")
    if not os.path.isdir(args.shm_dir):
        raise _usage(f"--shm-dir {args.shm_dir!r} is not a directory")
    configs = []
    for m in models:
        try:
            name, config = load_model_config(m)
            configs.append((config, Geometry.of(name, config, args.chunk_tokens)))
        except (ValueError, KeyError) as exc:
            raise _usage(f"--models {m!r}: {exc}") from None
    return {"configs": configs, "lengths": lengths, "lanes": lanes, "sidecar_cpus": sidecar_cpus,
            "sweep": sweep_lengths(lengths, _ints("sweep-lengths", args.sweep_lengths))}


def peer_lengths(geometry: Geometry, lengths: Sequence[int], max_kv_bytes: float,
                 shm_free: int) -> tuple[list[int], dict[int, str]]:
    """(lengths whose peer hit fits the limits, {length: why it does not} for the others)."""
    fits, skipped = [], {}
    for n in lengths:
        kv = geometry.kv_bytes(n)
        need = SHM_COPIES * (geometry.chunks(n) + 2) * geometry.row_stride
        if kv > max_kv_bytes:
            skipped[n] = f"peer hit not measured: {kv / 2**30:.1f} GiB of KV > --max-kv-gib {max_kv_bytes / 2**30:g}"
        elif need > shm_free:
            skipped[n] = (f"peer hit not measured: needs {need / 2**30:.1f} GiB of shared memory, "
                          f"{shm_free / 2**30:.1f} GiB free")
        else:
            fits.append(n)
    return fits, skipped


def _model_report(config: dict[str, Any], geometry: Geometry, plan: dict[str, Any],
                  args: argparse.Namespace, dev: str, progress: Callable[[str], None],
                  measured: Callable[[dict[str, Any]], None] = lambda model: None) -> dict[str, Any]:
    """The model's report; ``measured`` gets the report so far after the prefill and each pool."""
    from kv_offload_tools.bench.gpu.peer import measure_peer_hits
    from kv_offload_tools.bench.gpu.prefill import measure_prefill

    lengths = plan["lengths"]
    prefill = {p.tokens: p for p in measure_prefill(config, lengths, repeats=args.repeats, progress=progress)}
    fits, skipped = peer_lengths(geometry, lengths, args.max_kv_gib * 2**30,
                                 shutil.disk_usage(args.shm_dir).free)
    settings = PeerSettings(plane=args.plane, repeats=args.repeats, timeout_s=args.timeout_s,
                            shm_dir=args.shm_dir)
    swept = [n for n in fits if n in plan["sweep"]]
    runs: list[tuple[list[int], int | None, Any, int | None]] = [  # (lengths, lanes, CPUs, sidecar CPUs)
        (fits if i == len(plan["lanes"]) - 1 else swept, lanes, None, None) for i, lanes in enumerate(plan["lanes"])]
    runs += [(swept, None, cpus, count) for count, cpus in plan["sidecar_cpus"]]
    pools: list[dict[str, Any]] = []
    report = _assembled(geometry, prefill, skipped, pools)
    measured(report)
    for chosen, lanes, cpus, count in runs:
        if chosen:
            pools.append({**measure_peer_hits(geometry, chosen, lanes, settings, dev, cpus=cpus, progress=progress),
                          "sidecar_cpus": count})
            report = _assembled(geometry, prefill, skipped, pools)
            measured(report)
    return report


def _assembled(geometry: Geometry, prefill: dict[int, Any], skipped: dict[int, str],
               pools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A model's report: per length its recompute and its hits in every pool measured so far."""
    rows = []
    for n, p in sorted(prefill.items()):
        kv = geometry.kv_bytes(n)
        row: dict[str, Any] = {"tokens": n, "chunks": geometry.chunks(n), "kv_bytes": kv,
                               "recompute_s": p.seconds, "recompute_runs_s": list(p.runs),
                               "breakeven_gbps": breakeven_gbps(kv, p.seconds) if p.seconds else None,
                               "peer": []}
        if p.error:
            row["recompute_error"] = p.error
        if n in skipped:
            row["peer_skipped"] = skipped[n]
        for pool in pools:
            hit = pool["hits"].get(n)
            if hit is not None:
                row["peer"].append({"lanes": pool["lanes"], "sidecar_cpus": pool["sidecar_cpus"], **hit,
                                    "speedup": speedup(p.seconds, hit["hit_s"]) if p.seconds else None,
                                    "ratio_to_raw_tcp": hit["fetch_gbps"] / pool["raw_tcp"]["gbps"]})
        rows.append(row)
    first = next(iter(prefill.values()))
    return {"geometry": geometry.summary(), "prefill_layers_timed": first.layers_timed,
            "layer_scale": first.layer_scale, "rows": rows,
            "pools": [{k: v for k, v in pool.items() if k != "hits"} for pool in pools]}


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand: 0 when every peer hit landed the holder's bytes."""
    import torch
    import transformers

    from kv_offload_tools.bench.gpu.pinning import cpu_list
    from kv_offload_tools.bench.gpu.prefill import device
    from kv_offload_tools.bench.gpu.report import plot, table, targets

    dev = device()
    plan = parse(args, dev == "cuda")
    progress = timestamped("bench gpu")
    holder, fetcher = split_cpus(os.sched_getaffinity(0))
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__, "plane": args.plane, "cpus": len(os.sched_getaffinity(0)),
        "pinning": {"holder": cpu_list(holder), "fetcher": cpu_list(fetcher)},
        "lengths": plan["lengths"], "sweep_lengths": plan["sweep"],
        "lanes": ["default" if n is None else n for n in plan["lanes"]],
        "sidecar_cpus": [count for count, _ in plan["sidecar_cpus"]], "models": []}
    progress(f"{report['device']}: models {', '.join(g.name for _, g in plan['configs'])}; lengths "
             f"{','.join(map(str, plan['lengths']))}; lanes {','.join(map(str, report['lanes']))}; sidecar CPUs "
             f"{','.join(map(str, report['sidecar_cpus'])) or 'half each'}; holder on "
             f"CPUs {report['pinning']['holder']}, fetcher on {report['pinning']['fetcher']}")
    done: list[dict[str, Any]] = []

    def save(model: dict[str, Any]) -> None:
        """The report with the models done and ``model`` as measured so far, in --json's file
        (a run cut short keeps what it measured) and, once a model is done, the plot."""
        report["models"] = [*done, model]
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        report["targets"] = targets(report)
        if args.json not in ("", JSON_TO_STDOUT):
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=1)

    for config, geometry in plan["configs"]:
        model = _model_report(config, geometry, plan, args, dev, progress, measured=save)
        if args.plot:
            report["plot"] = os.path.abspath(args.plot)
        save(model)
        done.append(model)
        if args.plot:
            plot(report, args.plot)
    print(json.dumps(report, indent=1) if args.json == JSON_TO_STDOUT else table(report))
    bad = [f"{m['geometry']['name']} {r['tokens']} lanes {p['lanes']}" for m in report["models"]
           for r in m["rows"] for p in r["peer"] if not (p["identical"] and p["all_loaded"])]
    for b in bad:
        print(f"[FAILED] {b}: the fetched rows are not the holder's bytes, or chunks were missed", file=sys.stderr)
    return 1 if bad else 0
