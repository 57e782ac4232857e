"""PodNetwork: pods reach each other only through the router, whose rules drop packets silently
one way, whose tbf caps a pod's bandwidth, and whose namespaces go away with their owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from kv_offload_tools.netns.ip import in_netns
from kv_offload_tools.netns.network import HOSTS_ROOT, PodNetwork, namespaces, sweep_stale
from kv_offload_tools.netns.probes import datagram_crosses, transfer_rate
from waiting import wait_for

# Runs in a child process: make a network, report its prefix, then wait to be killed.
OWNER_SCRIPT = """
import json, time
from kv_offload_tools.netns.network import PodNetwork
net = PodNetwork().create(2)
print(json.dumps({"prefix": net.prefix, "pods": [p.netns for p in net.pods]}), flush=True)
time.sleep(600)
"""


def test_a_one_way_partition_drops_packets_from_a_to_b_only_until_healed(clean_net: PodNetwork):
    net = clean_net
    assert datagram_crosses(net, 0, 1) and datagram_crosses(net, 1, 0)
    net.partition(0, 1, one_way=True)
    # The way back still works (proved first), then the way there does not.
    assert datagram_crosses(net, 1, 0)
    assert datagram_crosses(net, 0, 2)
    assert not datagram_crosses(net, 0, 1)
    net.heal()
    assert wait_for("pod 0 to reach pod 1 again", lambda: datagram_crosses(net, 0, 1))


def test_a_partition_of_one_port_drops_only_tcp_to_that_port(clean_net: PodNetwork):
    net = clean_net
    net.partition(0, 1, port=5710)
    assert datagram_crosses(net, 0, 1)  # UDP, and TCP to other ports, still cross
    assert transfer_rate(net, 0, 1, 64 << 10) > 0


def test_each_pod_resolves_the_pool_name_to_every_pod_address(net: PodNetwork):
    script = ("import json, socket; print(json.dumps(sorted({i[4][0] for i in "
              f"socket.getaddrinfo({net.pool_name!r}, None, type=socket.SOCK_STREAM)}})))")
    want = sorted(p.ip for p in net.pods)
    for pod in net.pods:
        assert json.loads(in_netns(pod.netns, [sys.executable, "-c", script])) == want, pod.netns


def test_a_bandwidth_cap_holds_a_transfer_below_one_and_a_half_times_the_cap(clean_net: PodNetwork):
    net = clean_net
    cap_bits = 16_000_000  # 2 MB/s: 512 KiB take about a quarter of a second
    net.cap_bandwidth(1, cap_bits)
    rate = transfer_rate(net, 0, 1, 512 << 10)
    assert rate < 1.5 * cap_bits / 8, f"{rate / 1e6:.2f} MB/s through a {cap_bits / 8e6:.0f} MB/s cap"
    net.uncap(1)
    assert transfer_rate(net, 0, 1, 4 << 20) > 3 * cap_bits / 8


def test_destroy_leaves_no_namespace_or_hosts_file_with_the_network_prefix(netns_permitted: None):
    network = PodNetwork().create(2)
    made = [n for n in namespaces() if n.startswith(network.prefix)]
    assert len(made) == 3  # router and two pods
    network.destroy()
    assert [n for n in namespaces() if n.startswith(network.prefix)] == []
    assert not any(name.startswith(network.prefix) for name in
                   (os.listdir(HOSTS_ROOT) if os.path.isdir(HOSTS_ROOT) else []))


def test_the_namespaces_of_a_killed_owner_are_swept(netns_permitted: None):
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(owner.stdout.readline())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        owner.stdout.close()
    assert set(made["pods"]) <= set(namespaces())
    removed = sweep_stale()
    assert set(made["pods"]) <= set(removed)
    assert [n for n in namespaces() if n.startswith(made["prefix"])] == []
