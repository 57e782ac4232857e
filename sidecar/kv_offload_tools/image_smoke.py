"""`python -m kv_offload_tools.image_smoke IMAGE`: the image's sidecars and commands work.

What ``./dev image`` runs after building. Per data plane (tcp, ucx, nixl) a
``LocalPool`` of two sidecars runs from the image, each in a container started
with podman (runc; the host's network, PID and IPC namespaces, as two sidecars of
one node on the host network; the pool's work directory bind-mounted at the same
path, so config, keys, stores and local sockets are where the host side looks).
The containers run on one read-only copy of the image's root filesystem (buildah
mounts it once, with the image's entrypoint and environment): on vfs storage a
container of its own copies the whole image, half a minute each here.
The two handshake on loopback; one stores chunks through its engine channel and
the other loads them from it, every byte compared with what was stored (the
sidecars check each chunk's xxh3 on the way in as well); ``/readyz`` and
``/metrics`` answer on both; then each gets SIGTERM (podman passes it on) and must
exit 0. ``--rounds N`` repeats that per plane (two stops a round). Then the
image's ``kv-offload operator --help``, ``webhook-cert --help`` and ``translate``
(of a small Llama config) must exit 0 with their output. Last, NIXL beside
Debian's rdma-core (what an image built with a UCX_TARBALL carries): a container
installs ``libibverbs1`` and ``ibverbs-providers`` from Debian's archive, starts
a NIXL agent and exits; it must exit 0 with one libibverbs and one libnl-route in
the process (two copies crashed every nixl sidecar at exit).

The containers run as root here because the pool's files are the host user's; in
a pod the image runs as its numeric non-root user. Exit status: 0 when every
check passed, 1 otherwise, with one line per check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kv_offload_tools.chaos.chunks import chunk_keys, share_through_pool
from kv_offload_testing.local_pool import LocalPool

PLANES = ("tcp", "ucx", "nixl")
# Chunks each round shares from the first sidecar to the second.
CHUNKS = 8
# podman as ./dev image runs it: buildah's storage (vfs), runc, and rlimits the
# container may set where the host's hard limits are lower than podman's defaults.
STORAGE = ("--storage-driver", "vfs")
PODMAN = ("podman", *STORAGE, "--runtime", "runc")
RUN_FLAGS = ("--rm", "--network", "host", "--pid", "host", "--ipc", "host", "--user", "0:0",
             "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")
# Environment the sidecar reads (the rest of the host's stays out of the container).
PASSED_ENV = ("PYTHONHASHSEED", "UCXPY_PROGRESS_MODE")
PASSED_PREFIXES = ("UCX_", "KV_OFFLOAD_", "NIXL_")
# A model config translate can read: Llama-shaped, small.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "torch_dtype": "bfloat16", "vocab_size": 1000, "max_position_embeddings": 2048}
TIER = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":1073741824,"block_size":64,'
        '"secondary_tiers":[{"type":"KVOffloadSecondaryTier",'
        '"module_path":"kv_offload_sidecar.engine.vllm_tier"}]}}')


@dataclass(frozen=True)
class Check:
    """One check's outcome, printed as one line."""

    # What was checked, e.g. "nixl round 1".
    name: str
    # True when it passed.
    ok: bool
    # What was seen (exit codes, chunks read, the failure).
    detail: str


class ImageRoot:
    """The image's root filesystem, mounted once (buildah), for containers run from it."""

    def __init__(self, image: str) -> None:
        self.image = image
        inspect = subprocess.run(["buildah", *STORAGE, "inspect", "--type", "image", image],
                                 capture_output=True, text=True, check=True)
        config = json.loads(inspect.stdout)["OCIv1"]["config"]
        # The image's environment, entrypoint and working directory, as podman would apply them.
        self.env = tuple(config.get("Env") or ())
        self.entrypoint = tuple(config.get("Entrypoint") or ())
        self.workdir = config.get("WorkingDir") or "/"
        self.container = subprocess.run(["buildah", *STORAGE, "from", "-q", image], capture_output=True,
                                        text=True, check=True).stdout.strip()
        self.path = subprocess.run(["buildah", *STORAGE, "mount", self.container], capture_output=True,
                                   text=True, check=True).stdout.strip()

    def argv(self, args: Sequence[str], env: Mapping[str, str] | None = None,
             volumes: Sequence[str] = ()) -> list[str]:
        """``podman run`` of the image's entrypoint with ``args``; ``env`` adds the sidecar's own."""
        passed = [f"--env={k}={v}" for k, v in sorted((env or {}).items())
                  if k in PASSED_ENV or k.startswith(PASSED_PREFIXES)]
        mounts = [f"--volume={v}:{v}" for v in volumes]
        return [*PODMAN, "run", *RUN_FLAGS, "--read-only", "--tmpfs", "/tmp", "--workdir", self.workdir,
                *[f"--env={e}" for e in self.env], *passed, *mounts, "--rootfs", self.path,
                *self.entrypoint, *args]

    def launcher(self, workdir: str) -> Callable[[Sequence[str], Mapping[str, str]], list[str]]:
        """A LocalPool launcher running ``kv-offload ARGS`` from the image, ``workdir`` shared."""
        return lambda args, env: self.argv(args, env, volumes=[workdir])

    def close(self) -> None:
        subprocess.run(["buildah", *STORAGE, "rm", self.container], capture_output=True)


def check_plane(root: ImageRoot, plane: str, round_no: int) -> Check:
    """Two sidecars from the image on ``plane``: handshake, chunks from one to the other checked,
    probes, SIGTERM -> 0."""
    name = f"{plane} round {round_no}"
    workdir = tempfile.mkdtemp(prefix="kvo-image-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    pool = LocalPool(2, transport=plane, workdir=workdir, launcher=root.launcher(workdir),
                     fetch_deadline_seconds=5.0)
    failure = ""
    try:
        pool.start(timeout=120.0)
        keys = chunk_keys(f"image-{plane}-{round_no}", CHUNKS)
        read, wrong = share_through_pool(pool, keys, pool.chunk_bytes, timeout=10.0)
        probes = {sc.identity: (sc.get("/readyz", auth=False)[0],
                                "kv_offload_peers" in sc.metrics_text()) for sc in pool.sidecars}
        received = pool[1].metric("kv_offload_peer_bytes_total", direction="received")
    except Exception as exc:  # reported as this check's failure; the pool still stops
        failure = f"{type(exc).__name__}: {exc}; " + " ".join(
            f"log of {sc.identity}: {sc.log_tail(10)}" for sc in pool.sidecars)
    codes = pool.stop(timeout=30.0)
    shutil.rmtree(workdir, ignore_errors=True)
    if failure:
        return Check(name, False, f"{failure}; exit codes on SIGTERM {codes}")
    ok = (read, wrong) == (CHUNKS, 0) and received >= CHUNKS * pool.chunk_bytes \
        and all(p == (200, True) for p in probes.values()) and set(codes.values()) == {0}
    return Check(name, ok, f"{read}/{CHUNKS} chunks read from the peer, {wrong} wrong; "
                           f"/readyz and /metrics {probes}; exit codes on SIGTERM {codes}")


def check_commands(root: ImageRoot) -> list[Check]:
    """The image's operator, webhook-cert and translate commands run."""
    checks = []
    for args, expect in ((["operator", "--help"], "usage"), (["webhook-cert", "--help"], "usage")):
        proc = subprocess.run(root.argv(args), capture_output=True, text=True, timeout=300)
        checks.append(Check(" ".join(args), proc.returncode == 0 and expect in proc.stdout,
                            f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip().splitlines()[:1]}"))
    tmp = tempfile.mkdtemp(prefix="kvo-image-translate-")
    try:
        config = os.path.join(tmp, "config.json")
        with open(config, "w") as fh:
            json.dump(TINY_LLAMA, fh)
        proc = subprocess.run(root.argv(["translate", "--vllm-args", f"vllm serve tiny --kv-transfer-config '{TIER}'",
                                         "--model-config", config], volumes=[tmp]),
                              capture_output=True, text=True, timeout=300)
        try:
            fingerprint = json.loads(proc.stdout).get("fingerprint", "")
        except ValueError:
            fingerprint = ""
        checks.append(Check("translate", proc.returncode == 0 and len(fingerprint) == 16,
                            f"exit {proc.returncode}, fingerprint {fingerprint or proc.stderr.strip()[-200:]}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checks


# Run as root in a container of the image: Debian's rdma-core, then a NIXL agent that exits.
NIXL_BESIDE_RDMA_CORE = r"""
apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends \
  libibverbs1 ibverbs-providers >/dev/null || exit 3
exec /opt/kv-offload/bin/python -c '
import nixl_cu12 as n
n.nixl_agent("smoke", n.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
maps = {line.split()[-1] for line in open("/proc/self/maps") if ".so" in line}
print(sum("libibverbs" in m for m in maps), sum("libnl-route" in m for m in maps))
'
"""


def check_nixl_beside_rdma_core(image: str) -> Check:
    proc = subprocess.run([*PODMAN, "run", *RUN_FLAGS, "--entrypoint", "/bin/bash", image,
                           "-c", NIXL_BESIDE_RDMA_CORE], capture_output=True, text=True, timeout=600)
    copies = proc.stdout.split()[-2:] if proc.stdout.split() else []
    return Check("nixl beside Debian's rdma-core", proc.returncode == 0 and copies == ["1", "1"],
                 f"exit {proc.returncode}, libibverbs and libnl-route copies loaded: {copies or proc.stderr[-300:]}")


def report(checks: list[Check], check: Check) -> None:
    checks.append(check)
    print(f"[{'ok' if check.ok else 'FAILED'}] {check.name}: {check.detail}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_offload_tools.image_smoke", description=__doc__.split("\n")[0])
    parser.add_argument("image", help="the image to check, e.g. localhost/kv-offload:0.1.0")
    parser.add_argument("--planes", default=",".join(PLANES), help="data planes to check (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="pools per plane, each two sidecars stopped by SIGTERM (default %(default)s)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    checks: list[Check] = []
    root = ImageRoot(args.image)
    try:
        for plane in args.planes.split(","):
            for round_no in range(1, args.rounds + 1):
                report(checks, check_plane(root, plane, round_no))
        for check in check_commands(root):
            report(checks, check)
    finally:
        root.close()
    report(checks, check_nixl_beside_rdma_core(args.image))
    failed = [c for c in checks if not c.ok]
    print(f"image smoke test of {args.image}: {len(checks) - len(failed)}/{len(checks)} checks passed "
          f"in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
