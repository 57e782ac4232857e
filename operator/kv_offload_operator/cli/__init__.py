"""The `kv-offload` command: a thin dispatcher over lazily imported subcommands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; the module is imported only when its command runs, so
``kv-offload sidecar`` never loads the operator runtime or kopf.
Exit codes: 0 success, 1 a negative answer (e.g. ``diff`` found differences),
2 bad input, with a one-line message on stderr that says what to change: a
subcommand reports bad input by raising ``UsageError`` (its message collapsed
to one line here), never by printing it itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kv_offload_sidecar.extras import DEMO, EXTRAS, TOOLS, missing
from kv_offload_sidecar.usage import UsageError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "translate": ("kv_offload_operator.cli.translate",
                  "vLLM serve arguments + the model's config.json -> OffloadingConfig JSON"),
    "fingerprint": ("kv_offload_operator.cli.fingerprint", "print the fingerprint of a config file"),
    "diff": ("kv_offload_operator.cli.diff", "compare the identity of two config files"),
    "sidecar": ("kv_offload_sidecar.commands.sidecar", "run the per-pod sidecar"),
    "operator": ("kv_offload_operator.cli.operator", "run the kopf operator and its webhook"),
    "webhook-cert": ("kv_offload_operator.cli.webhook_cert",
                     "create the webhook's TLS Secret once, or put its CA into the webhook's caBundle"),
    "demo": ("kv_offload_tools.demo", "several sidecars and simulated engines sharing chunks"),
    "install-tier": ("kv_offload_sidecar.commands.install_tier", "copy the vLLM-side tier into a shared volume"),
    "ucx-info": ("kv_offload_sidecar.commands.ucx_info",
                 "the UCX the sidecar loads: compiled-in transports, usable devices, memlock"),
    "admin-token": ("kv_offload_sidecar.commands.admin_token",
                    "print the admin bearer token derived from a pool key file"),
}
# bench name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "transport": ("kv_offload_tools.bench.transport.cli", "data-plane throughput against raw sockets"),
    "replay": ("kv_offload_tools.bench.replay.cli", "hit ratios replaying a Mooncake-format trace"),
    "chaos": ("kv_offload_tools.bench.chaos", "fault injection and fuzzing against live sidecars"),
    "scale": ("kv_offload_tools.bench.scale.cli", "where-is-what memory and traffic as the pool grows"),
    "vllm": ("kv_offload_tools.bench.vllm_ttft.cli",
             "time to first token inside real vLLM engines: recompute, local and peer hits"),
    "gpu": ("kv_offload_tools.bench.gpu.cli",
            "recompute on the GPU against a peer hit landing in GPU memory, per prompt length"),
    "attack": ("kv_offload_tools.bench.attack.cli",
               "hostile clients against a live pool: memory, logs and the honest load"),
    "netns": ("kv_offload_tools.bench.netns.cli",
              "pods in network namespaces: what silent and asymmetric partitions cost today"),
    "descriptors": ("kv_offload_tools.bench.descriptors",
                    "the demo's hit ratio with every process holding descriptors past 1,024"),
    "mesh": ("kv_offload_tools.bench.mesh.cli",
             "many real sidecars on this host: descriptors, threads, memory and handshakes per sidecar"),
    "restarts": ("kv_offload_tools.bench.restarts",
                 "a sidecar SIGKILLed again and again on a /dev/shm that holds one store"),
}


# What stores a bench's run as a dated record (``kv-offload bench NAME --record DIR``).
RECORDER = "kv_offload_tools.bench_records.recorder"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, nothing on stdout
        raise UsageError(f"{self.prog}: {message}")


def _add_lazy(sub: argparse._SubParsersAction, name: str, module: str, help_: str,
              wanted: str | None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module)
    if wanted == name:  # only the chosen command imports its module
        importlib.import_module(module).add_arguments(p)
    return p


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="kv-offload", description="Peer-to-peer sharing of vLLM's offloaded KV cache.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        _add_lazy(sub, name, module, help_, wanted)
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_) in BENCHES.items():
        p = _add_lazy(bench_sub, name, module, help_, wanted_bench)
        if wanted_bench == name:  # every bench can store its run as a dated record
            importlib.import_module(RECORDER).add_record_flag(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        module = getattr(args, "_module", None)
        if module is None:
            parser.print_help(sys.stderr)
            return 2
        run = importlib.import_module(module).run
        if getattr(args, "record", ""):
            return importlib.import_module(RECORDER).recorded(args, argv, run)
        return int(run(args) or 0)
    except UsageError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a part whose extra is not installed
        top = (exc.name or "").split(".")[0]
        tools = DEMO if argv[:1] == ["demo"] else TOOLS  # the demo needs only its own extra
        part = tools if top == "kv_offload_tools" else EXTRAS.get(top)
        if part is None:
            raise
        command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
        print(missing(top, f"kv-offload {command}", part), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
