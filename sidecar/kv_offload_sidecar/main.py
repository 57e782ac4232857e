"""`kv-offload sidecar`: run the per-pod sidecar until SIGTERM.

Bad flags, config or key file: one line on stderr, exit 2. SIGTERM/SIGINT:
stop accepting, let in-flight work finish within ``--shutdown-grace-seconds``,
unlink the shared-memory store, exit 0.
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

from .discovery import parse_peer_list
from .handshake import load_pool_key
from .offloading_config import load_config_file
from .settings import (DEFAULT_BASE_PORT, DEFAULT_DATA_PORT, DEFAULT_HOST, TRANSPORTS, SidecarSettings,
                       effective_hash_seed)

log = logging.getLogger("kv_offload_sidecar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--config", required=True, metavar="FILE",
                   help="offloading_config.json of the pool (the operator's ConfigMap)")
    p.add_argument("--pool-key-file", required=True, metavar="FILE",
                   help="file holding the pool's secret key (the operator's Secret)")
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
                   help="global DP indices this pod serves (default: the config's data_parallel_index)")
    p.add_argument("--data-port", type=int, default=DEFAULT_DATA_PORT,
                   help="TCP data-plane port (0: any free port)")
    p.add_argument("--capacity-bytes", type=int, default=1 << 30, help="chunk store byte budget")
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="data plane")
    p.add_argument("--shm-dir", default="/dev/shm", help="directory of the store file and local sockets")
    p.add_argument("--identity", default="", help="this sidecar's name in the pool (default hostname:port)")
    p.add_argument("--fetch-deadline-seconds", type=float, default=2.0,
                   help="deadline of one peer lookup or fetch; late is a miss")
    p.add_argument("--summary-interval-seconds", type=float, default=1.0,
                   help="seconds between key-summary pulls from each peer")
    p.add_argument("--dns-interval-seconds", type=float, default=10.0,
                   help="seconds between re-resolutions of --peers-dns")
    p.add_argument("--shutdown-grace-seconds", type=float, default=3.0,
                   help="bound on finishing in-flight work at SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def build_settings(args: argparse.Namespace) -> SidecarSettings:
    """Flags + environment + config -> settings; ValueError is one line for the user."""
    config = load_config_file(args.config)
    pool_key = load_pool_key(args.pool_key_file)
    host = args.host or os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST") or DEFAULT_HOST
    if args.base_port is not None:
        base_port = args.base_port
    else:
        env_port = os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT", "")
        if env_port and not (env_port.isascii() and env_port.isdigit()):
            raise ValueError(f"VLLM_P2P_SIDE_CHANNEL_PORT={env_port!r} is not a port number")
        base_port = int(env_port) if env_port else DEFAULT_BASE_PORT
    if args.dp_indices:
        try:
            dp_indices = tuple(int(x) for x in args.dp_indices.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--dp-indices {args.dp_indices!r} must be comma-separated integers") from None
    else:
        dp_indices = (config.parallel.data_parallel_index,)
    if not os.path.isdir(args.shm_dir):
        raise ValueError(f"--shm-dir {args.shm_dir!r} is not a directory: mount the pod's /dev/shm "
                         f"(or a memory-backed emptyDir) there or pass another directory")
    return SidecarSettings(
        config=config, pool_key=pool_key, host=host, base_port=base_port, dp_indices=dp_indices,
        data_port=args.data_port, capacity_bytes=args.capacity_bytes, transport=args.transport,
        shm_dir=args.shm_dir, identity=args.identity, static_peers=parse_peer_list(args.peers),
        peers_dns=args.peers_dns, dns_interval_seconds=args.dns_interval_seconds,
        summary_interval_seconds=args.summary_interval_seconds,
        fetch_deadline_seconds=args.fetch_deadline_seconds,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        hash_seed=effective_hash_seed(config))


async def _serve(settings: SidecarSettings) -> None:
    from .service import Sidecar

    sidecar = Sidecar(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            _start_shutdown_watchdog(settings.shutdown_grace_seconds)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await sidecar.serve(stop)


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
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr (diagnosing a stuck sidecar).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        settings = build_settings(args)
    except ValueError as exc:
        print(f"kv-offload sidecar: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings))
    except ValueError as exc:  # e.g. store geometry from the config and flags
        print(f"kv-offload sidecar: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # port in use, shm not writable
        print(f"kv-offload sidecar: {exc}", file=sys.stderr)
        return 1
    return 0
