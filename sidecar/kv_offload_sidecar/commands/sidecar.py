"""`kv-offload sidecar`: run the per-pod sidecar until SIGTERM.

Its flags are ``SidecarSettings``'s (name, default and help declared once, on
the field; ``setting_flags``) plus three of the process: ``--ucx-tls``,
``--parent-pid`` and ``--log-level``. Two deprecated aliases of ``--lanes`` (one meaning of
"lanes" on every plane: the streams a fetch stripes over) still work, each with a warning:
``--data-lanes N`` is ``--lanes N``; ``--ucx-lanes N`` (or ``$KV_OFFLOAD_UCX_LANES``) sets
the ucx plane's connections, which ``--lanes`` maps itself (``data.lanes.ucx_lanes``).

Bad flags, config or key file: one line on stderr, exit 2; a config file that does not load
at a restart of a pod whose sidecar once started runs that start's config instead, and says
so (``last_good_config``). SIGTERM/SIGINT:
stop accepting, let in-flight work finish within ``--shutdown-grace-seconds``,
unlink the shared-memory store, exit 0. With ``--parent-pid P`` (or
``KV_OFFLOAD_PARENT_PID``) the sidecar shuts down the same way once process P
is gone, so sidecars started by a test or bench die with it. With
``--transport ucx``, UCX's environment is set (``configure_ucx_env``) before
anything imports ``ucxx``.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from kv_offload_sidecar.bulk_copies import prepare_for_bulk_copies
from kv_offload_sidecar.engine.contract import ports
from kv_offload_sidecar.extras import require
from kv_offload_sidecar import last_good_config
from kv_offload_sidecar.peers.discovery import parse_peer_list
from kv_offload_sidecar.peers.handshake import load_pool_key
from kv_offload_sidecar.peers.pool_keys import load_optional_key
from kv_offload_sidecar.setting_flags import add_flags, flag_values
from kv_offload_sidecar.settings import GROUPS, SidecarSettings, default_identity, effective_hash_seed
from kv_offload_sidecar.commands.ucx_info import rdma_not_compiled_in
from kv_offload_sidecar.usage import UsageError

log = logging.getLogger("kv_offload_sidecar")

# Environment variable naming the process whose death stops the sidecar (tests, benches).
PARENT_PID_ENV = "KV_OFFLOAD_PARENT_PID"
# Deprecated: environment variable with the UCX lane count (use --lanes).
UCX_LANES_ENV = "KV_OFFLOAD_UCX_LANES"
# Seconds between checks that the --parent-pid process still lives.
PARENT_POLL_SECONDS = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings' flags (defaults and help from ``SidecarSettings``) in their groups
    (``settings.GROUPS``: one per group field of ``SidecarSettings``), the process's own among them."""
    groups = {g.name: parser.add_argument_group(g.name, g.about) for g in GROUPS}
    for g in GROUPS:
        add_flags(groups[g.name], SidecarSettings, names=[n for n in g.fields if n not in _PEER_SOURCES])
        if set(_PEER_SOURCES) <= set(g.fields):  # the two peer sources exclude each other
            add_flags(groups[g.name].add_mutually_exclusive_group(), SidecarSettings, names=_PEER_SOURCES)
    p = groups["data_plane"]
    p.add_argument("--ucx-tls", default=None, metavar="TLS",
                   help="UCX transports with --transport ucx (e.g. sm,tcp,self) or nixl (e.g. rc,cma,tcp,self) "
                        "(default $UCX_TLS, else the ucx transport's default)")
    p.add_argument("--data-lanes", default=None, metavar="N", type=int, dest="data_lanes_alias",
                   help="deprecated alias of --lanes (default --lanes)")
    p.add_argument("--ucx-lanes", default=None, metavar="N",
                   help="deprecated: UCX connections per peer with --transport ucx, 1 or 2; use --lanes, "
                        f"which ucx maps to 1 or 2 (default ${UCX_LANES_ENV}, else from --lanes)")
    p = groups["process"]
    p.add_argument("--parent-pid", default=None, metavar="PID",
                   help="shut down gracefully once this process is gone; 0: never "
                        f"(default ${PARENT_PID_ENV}, else 0)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


# The two peer sources, which exclude each other.
_PEER_SOURCES = ("static_peers", "peers_dns")


def build_settings(args: argparse.Namespace) -> SidecarSettings:
    """Flags + environment + config -> settings; ValueError is one line for the user."""
    values = flag_values(args, SidecarSettings)
    if getattr(args, "data_lanes_alias", None) is not None:
        if args.lanes not in (0, args.data_lanes_alias):
            raise ValueError(f"--data-lanes {args.data_lanes_alias} and --lanes {args.lanes} disagree: "
                             f"--data-lanes is a deprecated alias of --lanes, give --lanes alone")
        log.warning("--data-lanes is deprecated: use --lanes %d (the same streams on every plane)",
                    args.data_lanes_alias)
        values["lanes"] = args.data_lanes_alias
    values["pool_key"] = load_pool_key(args.pool_key_file)
    values["previous_pool_key"] = load_optional_key(args.previous_pool_key_file)
    values["admin_token"] = load_optional_key(args.admin_token_file)
    values["host"] = args.host or ports.env_host(os.environ)
    if args.base_port is None:
        values["base_port"] = ports.env_base_port(os.environ)
    if args.dp_indices is not None:  # per-engine values come from the pod (the webhook sets the flag)
        try:
            values["dp_indices"] = tuple(int(x) for x in args.dp_indices.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--dp-indices {args.dp_indices!r} must be comma-separated integers") from None
    identity = args.identity or default_identity(values["base_port"])
    saved = last_good_config.last_good_path(args.shm_dir, identity) if os.path.isdir(args.shm_dir) else None
    pool = last_good_config.load(args.config, saved=saved)
    config = values["config"] = pool.config
    values["declared_identity"] = pool.declared
    values["config_rejected"] = pool.rejected
    if args.static_peers is not None:
        values["static_peers"] = parse_peer_list(args.static_peers)
    if args.hash_seed is not None and args.hash_seed == "":
        raise ValueError("--hash-seed is empty: give the pool's seed (e.g. 0) or leave the flag out")
    values["hash_seed"] = effective_hash_seed(config, flag=args.hash_seed)
    if not os.path.isdir(args.shm_dir):
        raise ValueError(f"--shm-dir {args.shm_dir!r} is not a directory: mount the pod's /dev/shm "
                         f"(or a memory-backed emptyDir) there or pass another directory")
    return SidecarSettings.of(**values)


def parent_pid(args: argparse.Namespace) -> int:
    """The --parent-pid (else $KV_OFFLOAD_PARENT_PID) to outlive, 0 for none; ValueError if malformed."""
    if args.parent_pid is not None:
        raw, name = args.parent_pid, "--parent-pid"
    else:
        raw, name = os.environ.get(PARENT_PID_ENV, ""), PARENT_PID_ENV
    if raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{name} {raw!r} is not a process id (a non-negative integer; 0 turns it off)")
    return int(raw)


def ucx_tls(args: argparse.Namespace) -> str:
    """--ucx-tls, else $UCX_TLS, else the ucx transport's default; ValueError when empty."""
    from kv_offload_sidecar.data.ucx.runtime import DEFAULT_TLS

    tls = args.ucx_tls if args.ucx_tls is not None else os.environ.get("UCX_TLS") or DEFAULT_TLS
    if not tls.strip():
        raise ValueError("--ucx-tls is empty: give UCX transports such as sm,tcp,self")
    return tls


def ucx_lanes(args: argparse.Namespace, lanes: int = 0) -> int:
    """The ucx plane's connections per peer: ``lanes`` (``--lanes``) mapped by
    ``data.lanes.ucx_lanes``, unless the deprecated --ucx-lanes (else $KV_OFFLOAD_UCX_LANES)
    names 1 or 2, which wins with a warning; ValueError naming the choices."""
    from kv_offload_sidecar.data.lanes import ucx_lanes as mapped

    raw = args.ucx_lanes if args.ucx_lanes is not None else os.environ.get(UCX_LANES_ENV)
    if raw is None or raw == "":
        return mapped(lanes)
    name = "--ucx-lanes" if args.ucx_lanes is not None else UCX_LANES_ENV
    if raw.strip() not in ("1", "2"):
        raise ValueError(f"{name} {raw!r} is not a lane count; use 1 (the holder copies every "
                         "chunk) or 2 (the fetcher copies every third chunk too)")
    log.warning("%s is deprecated: use --lanes %s (ucx runs 1 connection for --lanes 0 or 1, 2 above)",
                name, raw.strip())
    return int(raw)


def configure_ucx(tls: str, lanes: int = 1) -> dict[str, str]:
    """Set UCX's environment for this process (before ``ucxx`` is imported).

    The chosen ``tls`` always wins; other UCX variables already in the
    environment (e.g. the pod's ``UCX_TCP_TX_SEG_SIZE``) are kept. UCX's own
    log goes to stderr unless ``UCX_LOG_FILE`` says otherwise.
    """
    from kv_offload_sidecar.data.ucx.runtime import configure_ucx_env

    os.environ["UCX_TLS"] = tls
    # UCX logs to stdout by default; a sidecar's stdout stays clean.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    return configure_ucx_env(tls, lanes=lanes, override=False)


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited process nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


async def _watch_parent(pid: int, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` once process ``pid`` is gone.

    When ``pid`` is this process's parent, being re-parented is the sign (no
    confusion with a reused pid); otherwise the process must no longer exist.
    """
    direct = os.getppid() == pid
    while (os.getppid() == pid) if direct else process_alive(pid):
        await asyncio.sleep(PARENT_POLL_SECONDS)
    log.warning("parent process %d is gone; shutting down", pid)
    on_gone()


async def _serve(settings: SidecarSettings, parent: int = 0) -> None:
    from kv_offload_sidecar.lifecycle import serve
    from kv_offload_sidecar.sidecar import Sidecar

    sidecar = Sidecar(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            _start_shutdown_watchdog(settings.process.shutdown_grace_seconds)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watcher = asyncio.create_task(_watch_parent(parent, on_signal)) if parent else None
    try:
        await serve(sidecar, stop)
    finally:
        if watcher is not None:
            watcher.cancel()


def _start_shutdown_watchdog(grace: float) -> None:
    """Bound the whole shutdown: a stuck one dumps its stacks and exits 1."""
    bound = 2 * grace + 5.0

    def expire() -> None:
        log.error("shutdown took longer than %.1fs; thread stacks follow, exiting", bound)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(bound, expire)
    timer.daemon = True
    timer.start()


def run(args: argparse.Namespace) -> int:
    prepare_for_bulk_copies()  # may re-execute this process once
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr (diagnosing a stuck sidecar).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        settings = build_settings(args)
        parent = parent_pid(args)
        if settings.data_plane.transport == "ucx":
            require("--transport ucx", "ucxx")
            tls = ucx_tls(args)
            configure_ucx(tls, ucx_lanes(args, settings.data_plane.lanes))
            if (problem := rdma_not_compiled_in(tls)) is not None:
                raise ValueError(problem)
        elif settings.data_plane.transport == "nixl":
            from kv_offload_sidecar.data.lanes import lanes_offered
            from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env
            configure_nixl_env(args.ucx_tls, lanes=lanes_offered(settings.data_plane.lanes))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"kv-offload sidecar: {exc}") from None
    if parent and os.getppid() != parent and not process_alive(parent):
        print(f"kv-offload sidecar: parent process {parent} is already gone", file=sys.stderr)
        return 1
    try:
        asyncio.run(_serve(settings, parent))
    except ValueError as exc:  # e.g. store geometry from the config and flags
        raise UsageError(f"kv-offload sidecar: {exc}") from None
    except OSError as exc:  # port in use, shm not writable
        print(f"kv-offload sidecar: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if settings.data_plane.transport == "ucx" and type(exc).__module__.startswith("ucxx"):
            # e.g. UCXXNoDeviceError: none of the transports in UCX_TLS is usable here.
            print(f"kv-offload sidecar: UCX could not start with UCX_TLS={os.environ.get('UCX_TLS')!r}: "
                  f"{type(exc).__name__}: {exc}; pick usable transports with --ucx-tls "
                  f"(e.g. tcp,self or sm,tcp,self)", file=sys.stderr)
            return 1
        raise
    return 0
