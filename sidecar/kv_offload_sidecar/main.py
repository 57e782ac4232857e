"""`kv-offload sidecar`: run the per-pod sidecar until SIGTERM.

Bad flags, config or key file: one line on stderr, exit 2. SIGTERM/SIGINT:
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

from kv_offload_sidecar.bulk_copies import reexec_for_bulk_copies
from kv_offload_sidecar.engine import ports
from kv_offload_sidecar.engine.offloading_config import load_config_file
from kv_offload_sidecar.peers.discovery import parse_peer_list
from kv_offload_sidecar.peers.handshake import load_pool_key
from kv_offload_sidecar.peers.pool_keys import load_optional_key
from kv_offload_sidecar.settings import (
    DEFAULT_DATA_PORT,
    PEER_COPIES,
    TRANSPORTS,
    SidecarSettings,
    effective_hash_seed,
)
from kv_offload_sidecar.usage import UsageError

log = logging.getLogger("kv_offload_sidecar")

# Environment variable naming the process whose death stops the sidecar (tests, benches).
PARENT_PID_ENV = "KV_OFFLOAD_PARENT_PID"
# Environment variable with the UCX lane count when --ucx-lanes is not given.
UCX_LANES_ENV = "KV_OFFLOAD_UCX_LANES"
# Seconds between checks that the --parent-pid process still lives.
PARENT_POLL_SECONDS = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--config", required=True, metavar="FILE",
                   help="offloading_config.json of the pool (the operator's ConfigMap)")
    p.add_argument("--pool-key-file", required=True, metavar="FILE",
                   help="file holding the pool's secret key (the operator's Secret); re-read "
                        "while running, so a rotated Secret takes effect without a restart")
    p.add_argument("--previous-pool-key-file", default="", metavar="FILE",
                   help="file of the pool's previous key, accepted while a key rotation rolls "
                        "out (absent or empty: none)")
    p.add_argument("--admin-token-file", default="", metavar="FILE",
                   help="file of a bearer token for the admin endpoints (/v1/status, /v1/peers, "
                        "/v1/lookup), besides the token derived from the pool key")
    p.add_argument("--key-reload-seconds", type=float, default=2.0,
                   help="seconds between re-reads of the key and token files")
    p.add_argument("--tls-cert-file", default="", metavar="PEM",
                   help="this sidecar's certificate: TLS on the tcp data plane (with --tls-key-file "
                        "and --tls-ca-file)")
    p.add_argument("--tls-key-file", default="", metavar="PEM", help="private key of --tls-cert-file")
    p.add_argument("--tls-ca-file", default="", metavar="PEM",
                   help="CA bundle that signs every pool member's certificate")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--peers", default="", metavar="H:P,...",
                       help="static peer control addresses (one DP port per peer is enough)")
    peers.add_argument("--peers-dns", default="", metavar="NAME",
                       help="DNS name of the pool's headless Service, re-resolved periodically")
    p.add_argument("--host", default=None,
                   help="address to bind and advertise (default $VLLM_P2P_SIDE_CHANNEL_HOST or localhost)")
    p.add_argument("--base-port", type=int, default=None,
                   help="control port of global DP index 0 (default $VLLM_P2P_SIDE_CHANNEL_PORT or 5710)")
    p.add_argument("--dp-indices", default="", metavar="I,...",
                   help="global DP indices this pod serves (default: 0)")
    p.add_argument("--data-port", type=int, default=DEFAULT_DATA_PORT,
                   help="TCP data-plane port (0: any free port)")
    p.add_argument("--capacity-bytes", type=int, default=1 << 30, help="chunk store byte budget")
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="data plane")
    p.add_argument("--shm-dir", default="/dev/shm", help="directory of the store file and local sockets")
    p.add_argument("--identity", default="", help="this sidecar's name in the pool (default hostname:port)")
    p.add_argument("--fetch-deadline-seconds", type=float, default=2.0,
                   help="deadline of one peer lookup or fetch; late is a miss")
    p.add_argument("--publish-interval-seconds", type=float, default=1.0,
                   help="seconds between publishes of this sidecar's chunk changes to the directory "
                        "(how stale a peer's view of them may be)")
    p.add_argument("--peer-copies", choices=PEER_COPIES, default="drop",
                   help="what to keep of a chunk fetched from a peer once the engine loaded it: "
                        "drop (the pool keeps one copy; default) or cold (a copy evicted first)")
    p.add_argument("--prefill-tokens-per-second", type=float, default=0.0, metavar="TOKENS",
                   help="the engine's prefill rate: a peer's run slower to fetch than to recompute "
                        "at this rate is a miss (default 0: always fetch)")
    p.add_argument("--engine-metrics-url", default="", metavar="URL",
                   help="vLLM's /metrics, to learn the engine's prefill rate from "
                        "(e.g. http://127.0.0.1:8000/metrics; default: the configured rate only)")
    p.add_argument("--engine-metrics-interval-seconds", type=float, default=15.0,
                   help="seconds between scrapes of --engine-metrics-url (default 15)")
    p.add_argument("--dns-interval-seconds", type=float, default=10.0,
                   help="seconds between re-resolutions of --peers-dns")
    p.add_argument("--shutdown-grace-seconds", type=float, default=3.0,
                   help="bound on finishing in-flight work at SIGTERM")
    p.add_argument("--ucx-tls", default=None, metavar="TLS",
                   help="UCX transports with --transport ucx (e.g. sm,tcp,self) or nixl (e.g. rc,cma,tcp,self) "
                        "(default $UCX_TLS, else the ucx transport's default)")
    p.add_argument("--ucx-lanes", default=None, metavar="N",
                   help="UCX connections per peer with --transport ucx: 1 (the holder copies each "
                        "chunk) or 2 (the fetcher copies every third, faster between same-host "
                        f"peers; a holder killed mid-transfer can then abort this sidecar too) "
                        f"(default ${UCX_LANES_ENV}, else 1)")
    p.add_argument("--hash-seed", default=None, metavar="S",
                   help="prefix-hash seed shared by the pool (default: the config's extra_config "
                        "hash_seed, else $PYTHONHASHSEED, else 0)")
    p.add_argument("--parent-pid", default=None, metavar="PID",
                   help=f"shut down gracefully once this process is gone (default ${PARENT_PID_ENV}; "
                        "0: never)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def build_settings(args: argparse.Namespace) -> SidecarSettings:
    """Flags + environment + config -> settings; ValueError is one line for the user."""
    config = load_config_file(args.config)
    pool_key = load_pool_key(args.pool_key_file)
    host = args.host or ports.env_host(os.environ)
    base_port = args.base_port if args.base_port is not None else ports.env_base_port(os.environ)
    if args.dp_indices:
        try:
            dp_indices = tuple(int(x) for x in args.dp_indices.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--dp-indices {args.dp_indices!r} must be comma-separated integers") from None
    else:
        dp_indices = (0,)  # per-engine values come from the pod (the webhook sets the flag)
    if args.hash_seed is not None and args.hash_seed == "":
        raise ValueError("--hash-seed is empty: give the pool's seed (e.g. 0) or leave the flag out")
    if not os.path.isdir(args.shm_dir):
        raise ValueError(f"--shm-dir {args.shm_dir!r} is not a directory: mount the pod's /dev/shm "
                         f"(or a memory-backed emptyDir) there or pass another directory")
    return SidecarSettings(
        config=config, pool_key=pool_key, host=host, base_port=base_port, dp_indices=dp_indices,
        data_port=args.data_port, capacity_bytes=args.capacity_bytes, transport=args.transport,
        shm_dir=args.shm_dir, identity=args.identity, static_peers=parse_peer_list(args.peers),
        peers_dns=args.peers_dns, dns_interval_seconds=args.dns_interval_seconds,
        publish_interval_seconds=args.publish_interval_seconds,
        fetch_deadline_seconds=args.fetch_deadline_seconds,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        hash_seed=effective_hash_seed(config, flag=args.hash_seed),
        pool_key_file=args.pool_key_file,
        previous_pool_key=load_optional_key(args.previous_pool_key_file),
        previous_pool_key_file=args.previous_pool_key_file,
        admin_token=load_optional_key(args.admin_token_file),
        admin_token_file=args.admin_token_file, key_reload_seconds=args.key_reload_seconds,
        tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file, tls_ca_file=args.tls_ca_file,
        peer_copies=args.peer_copies, prefill_tokens_per_second=args.prefill_tokens_per_second,
        engine_metrics_url=args.engine_metrics_url,
        engine_metrics_interval_seconds=args.engine_metrics_interval_seconds)


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


def ucx_lanes(args: argparse.Namespace) -> int:
    """--ucx-lanes, else $KV_OFFLOAD_UCX_LANES, else 1; ValueError naming the choices."""
    raw = args.ucx_lanes if args.ucx_lanes is not None else os.environ.get(UCX_LANES_ENV) or "1"
    name = "--ucx-lanes" if args.ucx_lanes is not None else UCX_LANES_ENV
    if raw.strip() not in ("1", "2"):
        raise ValueError(f"{name} {raw!r} is not a lane count; use 1 (the holder copies every "
                         "chunk) or 2 (the fetcher copies every third chunk too)")
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
            _start_shutdown_watchdog(settings.shutdown_grace_seconds)

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
    reexec_for_bulk_copies()  # returns once the copy tunable is in effect
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr (diagnosing a stuck sidecar).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        settings = build_settings(args)
        parent = parent_pid(args)
        if settings.transport == "ucx":
            configure_ucx(ucx_tls(args), ucx_lanes(args))
        elif settings.transport == "nixl":
            from kv_offload_sidecar.data.nixl.runtime import configure_nixl_env
            configure_nixl_env(args.ucx_tls)
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
        if settings.transport == "ucx" and type(exc).__module__.startswith("ucxx"):
            # e.g. UCXXNoDeviceError: none of the transports in UCX_TLS is usable here.
            print(f"kv-offload sidecar: UCX could not start with UCX_TLS={os.environ.get('UCX_TLS')!r}: "
                  f"{type(exc).__name__}: {exc}; pick usable transports with --ucx-tls "
                  f"(e.g. tcp,self or sm,tcp,self)", file=sys.stderr)
            return 1
        raise
    return 0
