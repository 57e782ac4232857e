"""PodNetwork: a router namespace and one namespace per pod, with the faults a network has.

Each pod is a network namespace with loopback up and one veth (``eth0``) to the
router namespace (``v<index>`` there). Addresses come from one private /24,
10.247.0.0/24, that exists only inside these namespaces (the router is .1, pod i
is .(10+i)); the root namespace gets no address or route, so pools of different
processes never collide. The router forwards between pods by /32 routes, so
every pod-to-pod packet is routed there and its policy rules apply:

- ``partition(a, b)``: ``ip rule ... from A to B blackhole`` in the router, packets from
  A to B dropped without an answer (a silent one-way partition; ``one_way=False`` both
  ways; ``port`` only TCP to that port of B, e.g. B's control port); ``isolate(pod)``
  cuts a pod from every other both ways; ``heal()`` removes every rule;
- ``cap_bandwidth(pod, rate)``: ``tc ... tbf`` on both ends of the pod's veth (into the
  pod on the router's side, out of it on the pod's), in bits per second; ``uncap``.

Each pod resolves the pool's name (``pool_name``, a headless Service's stand-in) through
its own hosts file, ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over
/etc/hosts for what it runs there: the name maps to every listed pod's address (all of them,
as getaddrinfo returns for a headless Service; ``list_pod(pod, False)`` leaves one out, as
the endpoints of a deleted pod are); the file is rewritten in place on every change, so
running processes see it. Its ``resolv.conf`` (mounted the same way, written before any
process starts) names the router as nameserver, where nothing answers, so a name missing
from the hosts file fails at once; ``break_resolver`` takes the pool name out of every hosts
file (every lookup of it fails) until ``restore_resolver``. With ``cluster_domain`` the hosts
files name ``<pool_name>.<cluster_domain>`` and resolv.conf has Kubernetes' search entries
``<namespace>.svc.<domain> svc.<domain>``, so a ``.svc`` pool name resolves only once the
domain is taken from them (``peers.cluster_domain``): the search list alone finds nothing.

Names carry the owner's pid: ``kvn-<pid>-<tag>-r`` (router), ``...-p<i>`` (pods).
``destroy`` removes all of it (a deleted namespace takes its veth ends along);
``sweep_stale`` removes what processes that are gone left behind (killed runs).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from dataclasses import dataclass

from kv_offload_sidecar.commands.sidecar import process_alive

from kv_offload_tools.netns.ip import NetnsError, inside, ip, tc

# Prefix of every namespace (and /etc/netns folder) made here: "kvn-<owner pid>-...".
NETNS_PREFIX = "kvn-"
_OWNED = re.compile(rf"^{NETNS_PREFIX}(?P<pid>\d+)-")
# The /24 of the pods, only ever inside these namespaces.
SUBNET = "10.247.0"
ROUTER_IP = f"{SUBNET}.1"
# Last octet of pod 0 (pod i is FIRST_POD_OCTET + i).
FIRST_POD_OCTET = 10
MAX_PODS = 240
# Where `ip netns exec` finds the files it mounts over /etc for a namespace.
HOSTS_ROOT = "/etc/netns"
# Policy-rule priorities of the faults (below the main table's 32766).
FIRST_RULE_PRIORITY = 1000


@dataclass(frozen=True)
class Pod:
    """One pod's namespace and address."""

    # Position in the network (0-based).
    index: int
    # Network namespace name (`ip netns` name).
    netns: str
    # Its address, e.g. 10.247.0.10.
    ip: str

    @property
    def router_link(self) -> str:
        """Its veth end in the router namespace."""
        return f"v{self.index}"


def namespaces() -> list[str]:
    """Names of every named network namespace on this machine."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def sweep_stale(prefix: str = NETNS_PREFIX) -> list[str]:
    """Delete namespaces and hosts folders ``kvn-<pid>-*`` whose owner process is gone; their names."""
    removed = []
    for name in namespaces():
        m = _OWNED.match(name)
        if name.startswith(prefix) and m and not process_alive(int(m.group("pid"))):
            ip("netns", "del", name, check=False)
            removed.append(name)
    with contextlib.suppress(OSError):
        for name in os.listdir(HOSTS_ROOT):
            m = _OWNED.match(name)
            if name.startswith(prefix) and m and not process_alive(int(m.group("pid"))):
                shutil.rmtree(os.path.join(HOSTS_ROOT, name), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(HOSTS_ROOT)  # only when empty
    return removed


class PodNetwork:
    """A router namespace and pod namespaces; ``create`` makes them, ``destroy`` removes them."""

    def __init__(self, pool_name: str = "pool.kvo.test", tag: str | None = None,
                 cluster_domain: str | None = None) -> None:
        # The name every pod resolves to all pods' addresses.
        self.pool_name = pool_name
        # The cluster's DNS domain in each pod's resolv.conf (None: no search entries).
        self.cluster_domain = cluster_domain
        # Pods left out of the pool name's answer (stopped pods, as endpoints of deleted ones).
        self.unlisted: set[int] = set()
        # True while no pod resolves the pool name.
        self.resolver_broken = False
        # Prefix of this network's namespace names ("kvn-<pid>-<tag>-").
        self.prefix = f"{NETNS_PREFIX}{os.getpid()}-{tag or secrets.token_hex(3)}-"
        self.router = f"{self.prefix}r"
        self.pods: list[Pod] = []
        self._router_made = False
        # Priorities of the router's fault rules, in the order they were added.
        self._rules: list[int] = []
        self._capped: set[int] = set()

    # ---- building -----------------------------------------------------------------

    def create(self, n: int) -> "PodNetwork":
        """The router and ``n`` pods (after sweeping dead owners' namespaces)."""
        sweep_stale()
        try:
            ip("netns", "add", self.router)
            self._router_made = True
            ip("link", "set", "lo", "up", netns=self.router)
            with inside(self.router), open("/proc/sys/net/ipv4/ip_forward", "w") as fh:
                fh.write("1")
            for _ in range(n):
                self.add_pod()
        except BaseException:
            self.destroy()
            raise
        return self

    def add_pod(self) -> Pod:
        """One more pod namespace, linked to the router; every pod's hosts file names it."""
        i = len(self.pods)
        if i >= MAX_PODS:
            raise ValueError(f"a PodNetwork holds at most {MAX_PODS} pods")
        pod = Pod(i, f"{self.prefix}p{i}", f"{SUBNET}.{FIRST_POD_OCTET + i}")
        ip("netns", "add", pod.netns)
        self.pods.append(pod)
        r, link = self.router, pod.router_link
        ip("link", "set", "lo", "up", netns=pod.netns)
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", pod.netns, netns=r)
        ip("addr", "add", f"{ROUTER_IP}/32", "dev", link, netns=r)
        ip("link", "set", link, "up", netns=r)
        ip("route", "add", f"{pod.ip}/32", "dev", link, netns=r)
        ip("addr", "add", f"{pod.ip}/32", "dev", "eth0", netns=pod.netns)
        ip("link", "set", "eth0", "up", netns=pod.netns)
        ip("route", "add", f"{ROUTER_IP}/32", "dev", "eth0", netns=pod.netns)
        ip("route", "add", "default", "via", ROUTER_IP, "dev", "eth0", netns=pod.netns)
        self._write_hosts()
        return pod

    @property
    def resolved_name(self) -> str:
        """The name the hosts files map: the pool name, qualified with the cluster domain."""
        return f"{self.pool_name}.{self.cluster_domain}" if self.cluster_domain else self.pool_name

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        if not self.resolver_broken:
            lines += [f"{p.ip} {self.resolved_name}" for p in self.pods if p.index not in self.unlisted]
        text = "\n".join(lines) + "\n"
        resolv = [f"nameserver {ROUTER_IP}", "options timeout:1 attempts:1"]
        if self.cluster_domain:
            namespace = self.pool_name.split(".")[1] if self.pool_name.count(".") >= 2 else "default"
            resolv.append(f"search {namespace}.svc.{self.cluster_domain} svc.{self.cluster_domain}")
        for pod in self.pods:
            folder = os.path.join(HOSTS_ROOT, pod.netns)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as fh:  # in place: mounted files follow
                fh.write(text)
            if not os.path.exists(os.path.join(folder, "resolv.conf")):
                with open(os.path.join(folder, "resolv.conf"), "w") as fh:
                    fh.write("\n".join(resolv) + "\n")

    def list_pod(self, pod: int | Pod, listed: bool = True) -> None:
        """Put ``pod`` in the pool name's answer, or (``listed=False``) leave it out."""
        p = self.pod(pod)
        (self.unlisted.discard if listed else self.unlisted.add)(p.index)
        self._write_hosts()

    def break_resolver(self) -> None:
        """No pod resolves the pool name any more (until ``restore_resolver``)."""
        self.resolver_broken = True
        self._write_hosts()

    def restore_resolver(self) -> None:
        self.resolver_broken = False
        self._write_hosts()

    def pod(self, key: int | str | Pod) -> Pod:
        """A pod by index, namespace name or address (or itself)."""
        if isinstance(key, Pod):
            return key
        for p in self.pods:
            if key in (p.index, p.netns, p.ip):
                return p
        raise KeyError(f"the network has no pod {key!r}")

    # ---- faults -------------------------------------------------------------------

    def partition(self, a: int | Pod, b: int | Pod, *, one_way: bool = True, port: int | None = None) -> None:
        """Drop packets from ``a`` to ``b`` silently in the router (and back, unless ``one_way``);
        with ``port`` only TCP packets to that port of the receiving pod."""
        src, dst = self.pod(a), self.pod(b)
        for x, y in [(src, dst)] + ([] if one_way else [(dst, src)]):
            priority = FIRST_RULE_PRIORITY + len(self._rules)
            match = ["from", f"{x.ip}/32", "to", f"{y.ip}/32"]
            if port is not None:
                match += ["ipproto", "tcp", "dport", str(port)]
            ip("rule", "add", "priority", str(priority), *match, "blackhole", netns=self.router)
            self._rules.append(priority)

    def isolate(self, pod: int | Pod) -> None:
        """Cut ``pod`` from every other pod, both ways, silently."""
        target = self.pod(pod)
        for other in self.pods:
            if other != target:
                self.partition(target, other, one_way=False)

    def heal(self) -> None:
        """Remove every partition rule."""
        while self._rules:
            ip("rule", "del", "priority", str(self._rules.pop()), netns=self.router, check=False)

    def cap_bandwidth(self, pod: int | Pod, rate_bits: int) -> None:
        """Cap traffic into and out of ``pod`` at ``rate_bits`` bits per second (tbf)."""
        p = self.pod(pod)
        burst = max(16 << 10, rate_bits // 8 // 100)  # 10 ms at the rate, at least 16 KiB
        for netns, dev in ((self.router, p.router_link), (p.netns, "eth0")):
            tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bits}bit",
               "burst", str(burst), "latency", "100ms", netns=netns)
        self._capped.add(p.index)

    def uncap(self, pod: int | Pod) -> None:
        p = self.pod(pod)
        for netns, dev in ((self.router, p.router_link), (p.netns, "eth0")):
            tc("qdisc", "del", "dev", dev, "root", netns=netns, check=False)
        self._capped.discard(p.index)

    # ---- teardown -----------------------------------------------------------------

    def destroy(self) -> None:
        """Delete every namespace and hosts file of this network (idempotent)."""
        for pod in self.pods:
            ip("netns", "del", pod.netns, check=False)
            shutil.rmtree(os.path.join(HOSTS_ROOT, pod.netns), ignore_errors=True)
        if self._router_made:
            ip("netns", "del", self.router, check=False)
            self._router_made = False
        self.pods = []
        self._rules = []
        with contextlib.suppress(OSError):
            os.rmdir(HOSTS_ROOT)  # only when empty
        leftover = [n for n in namespaces() if n.startswith(self.prefix)]
        if leftover:
            raise NetnsError(f"namespaces left after destroy: {leftover}")

    def __enter__(self) -> "PodNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
