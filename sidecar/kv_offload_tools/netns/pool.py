"""NetnsPool: a LocalPool whose sidecars run one per pod namespace of a PodNetwork.

Each sidecar runs inside its pod's namespace (``ip netns exec``, through LocalPool's
launcher hook), binds the pod's address (``--host``) on the same control port as
every other pod (``base_port``, as pods of one Deployment do), and finds its peers
only by the pool's name (``--peers-dns``), which its namespace's hosts file maps to
every pod. Work directory, store files and local channel sockets are LocalPool's
(shared memory, the same in every network namespace).

The process that drives the pool (a test, the bench) stays in its own namespace;
``NetnsSidecar`` enters the pod's namespace for each control-API request and for
connecting an engine client (``ip.inside``), so a client made by ``client()``
is the pod's own engine: its control-port request comes from inside the pod, and
its local channel is the Unix socket. The pool's faults are its network's:
``pool.net.partition(...)``, ``pool.net.cap_bandwidth(...)``.

Pods come and go: ``stop_pod(i)`` stops pod i's sidecar and leaves its address out of the
pool name's answer (as the endpoints of a deleted pod leave a headless Service's);
``start_pod(i)`` lists it again and starts its sidecar again (same identity, address and
port). ``start_pod(i, override)`` starts instead a sidecar that is not of this pool (another
key or config, ``LocalPool``'s ``SidecarOverride``) in pod i's namespace, on its address and
port, finding its own pool by another name (``OTHER_POOL_NAME``, resolved by no pod): a pod
of another pool that took over a departed member's address. The resolver view is the
network's (``pool.net.break_resolver()``, ``list_pod``, ``cluster_domain``).

``stop`` stops the sidecars, then destroys the network (nothing left with its prefix).
``add`` is not supported (the pods are the network's; ``start_pod`` brings one back).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kv_offload_sidecar.engine.client import EngineClient

from kv_offload_testing.http_client import http_text
from kv_offload_testing.local_pool import LocalPool, SidecarOverride, sidecar_command
from kv_offload_tools.netns.ip import inside
from kv_offload_tools.netns.network import Pod, PodNetwork
from kv_offload_testing.sidecar_process import SidecarProcess

# Control port of every pod's sidecar (the sidecar's default, as in a real pool).
DEFAULT_BASE_PORT = 5710
# The headless Service's stand-in name.
DEFAULT_POOL_NAME = "pool.kvo.test"
# The name a sidecar of another pool looks its peers up by (no pod resolves it).
OTHER_POOL_NAME = "other-pool.kvo.test"


class NetnsSidecar(SidecarProcess):
    """A sidecar in a pod namespace; its control API and engine clients are reached from inside it."""

    # The pod's network namespace (set by NetnsPool before the first start).
    netns: str = ""

    def get(self, path: str, timeout: float = 5.0, *, auth: bool = True) -> tuple[int, Any]:
        with inside(self.netns):
            return super().get(path, timeout, auth=auth)

    def post(self, path: str, body: Any, timeout: float = 5.0, *, auth: bool = True) -> tuple[int, Any]:
        with inside(self.netns):
            return super().post(path, body, timeout, auth=auth)

    def metrics_text(self) -> str:
        with inside(self.netns):
            return http_text(self.url + "/metrics")

    def client(self, dp_index: int | None = None, timeout: float = 5.0) -> EngineClient:
        with inside(self.netns):
            return super().client(dp_index, timeout)


class NetnsPool(LocalPool):
    """``n`` pods, each a namespace with one sidecar; a context manager (see the module docstring)."""

    process_class = NetnsSidecar

    def __init__(self, n: int = 3, *, pool_name: str = DEFAULT_POOL_NAME,
                 base_port: int = DEFAULT_BASE_PORT, cluster_domain: str | None = None,
                 **kwargs: Any) -> None:
        if "launcher" in kwargs:
            raise TypeError("NetnsPool launches its sidecars itself (ip netns exec)")
        super().__init__(n, launcher=self._launch, **kwargs)
        self.base_port = base_port
        # The router and pod namespaces (made by start).
        self.net = PodNetwork(pool_name, cluster_domain=cluster_domain)
        self._pods: dict[str, Pod] = {}

    def start(self, timeout: float = 60.0) -> "NetnsPool":
        """Make the network, start one sidecar per pod, wait until all are ready and connected."""
        try:
            self.net.create(self.n)
            self._pods = {f"pod-{pod.index}": pod for pod in self.net.pods}
            self._start_members([(identity, self.base_port, ()) for identity in self._pods], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _sidecar(self, identity: str, base_port: int, peers: Sequence[str],
                 override: SidecarOverride | None, capacity_bytes: int | None,
                 expect_connect: bool) -> SidecarProcess:
        sc = super()._sidecar(identity, base_port, peers, override, capacity_bytes, expect_connect)
        pod = self._pods[identity]
        sc.host = pod.ip
        sc.netns = pod.netns  # type: ignore[attr-defined]
        return sc

    def _launch(self, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """``ip netns exec <pod> kv-offload sidecar ... --host <pod ip> --peers-dns <pool name>``."""
        argv = list(args)
        pod = self._pods[argv[argv.index("--identity") + 1]]
        argv[argv.index("--host") + 1] = pod.ip
        if "--peers-dns" not in argv:
            argv += ["--peers-dns", self.net.pool_name]
        return [shutil.which("ip") or "ip", "netns", "exec", pod.netns, *sidecar_command(), *argv]

    def pod(self, key: int | str) -> Pod:
        """The pod of a sidecar (by position or identity)."""
        return self._pods[self[key].identity]

    def add(self, *args: Any, **kwargs: Any) -> SidecarProcess:
        raise NotImplementedError("NetnsPool does not add sidecars after start: stop_pod/start_pod")

    def stop_pod(self, index: int, timeout: float = 10.0) -> int:
        """Stop pod ``index``'s sidecar and leave its address out of the pool name's answer."""
        code = self[index].terminate(timeout)
        self.net.list_pod(self.pod(index), False)
        return code

    def start_pod(self, index: int, override: SidecarOverride | None = None, *, wait: bool = True,
                  timeout: float = 60.0) -> SidecarProcess:
        """Start pod ``index``'s sidecar again (listed again), or with ``override`` a sidecar of
        another pool on its address (the pool name's answer left as it is)."""
        pod = self.pod(index)
        if self[index].alive():
            raise RuntimeError(f"{self[index].identity} still runs: stop_pod({index}) first")
        if override is None:
            self.net.list_pod(pod)
            self[index].start(wait=wait, timeout=timeout)
            return self[index]
        identity = f"other-{pod.index}-{len(self.sidecars)}"
        self._pods[identity] = pod
        o = replace(override, extra_args=(*override.extra_args, "--peers-dns", OTHER_POOL_NAME))
        sc = self._sidecar(identity, self.base_port, (), o, None, expect_connect=False)
        sc.index = index
        self.sidecars[index] = sc
        sc.start(wait=wait, timeout=timeout)
        return sc

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """Stop every sidecar, then remove the network."""
        try:
            return super().stop(timeout)
        finally:
            self.net.destroy()
