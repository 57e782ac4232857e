"""The pool's Service name gets the cluster domain of the pod's resolver configuration."""

from __future__ import annotations

from kv_offload_sidecar.peers.cluster_domain import qualify

POD_RESOLV_CONF = """# written by the kubelet
nameserver 10.96.0.10
search ns1.svc.corp.example svc.corp.example corp.example
options ndots:5
"""


def test_a_service_name_takes_the_domain_of_the_pods_search_list(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text(POD_RESOLV_CONF)
    assert qualify("llama-peers.ns1.svc", str(conf)) == "llama-peers.ns1.svc.corp.example"


def test_other_names_and_a_search_list_without_svc_are_left_to_the_resolver(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 10.0.0.2\nsearch corp.example\n")
    assert qualify("llama-peers.ns1.svc", str(conf)) == "llama-peers.ns1.svc"
    assert qualify("pool.kvo.test", str(conf)) == "pool.kvo.test"
    assert qualify("llama-peers.ns1.svc", str(tmp_path / "missing")) == "llama-peers.ns1.svc"
