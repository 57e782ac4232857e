"""A pool's spec read and defaulted (pool_spec.py), and the CRD that admits it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kv_offload_operator.pools import pool_objects, pool_spec
from kv_offload_operator.translation.translate import translate
from kv_offload_sidecar.settings import MAX_DATA_LANES
from operator_harness import KTC, LLAMA_ARGS, llama_config, pool_body
from pool_support import K8S, hash_seed_pool, pool, sidecar_spec

CRD_PATH = Path(__file__).parents[2] / "charts" / "kv-offload" / "files" / "crd-kvoffloadpools.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def test_sidecar_spec_defaults_and_rejects_bad_values_naming_the_field() -> None:
    s = pool_spec.SidecarSpec.from_pool(pool(), default_image="img:1")
    assert (s.image, s.capacity_bytes, s.transport, s.base_port, s.data_port) == \
        ("img:1", 4 << 30, "ucx", 5710, 5810)
    assert s.shm_size_limit is None  # each pod's: the store + vLLM's primary tier + 1 GiB (pod_host)
    with pytest.raises(ValueError, match=r"spec\.sidecar\.transport='rdma'"):
        sidecar_spec(transport="rdma")
    with pytest.raises(ValueError, match=r"spec\.sidecar\.capacityBytes=0"):
        sidecar_spec(capacityBytes=0)
    with pytest.raises(ValueError, match=r"spec\.sidecar\.image"):
        pool_spec.SidecarSpec.from_pool(pool(), default_image="")


@pytest.mark.parametrize("bad", ["abc", "-1", "4294967296", "", " 1", True, 1.5, "random"])
def test_hash_seed_must_be_a_seed_python_accepts(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"spec\.hashSeed=.*decimal integer in \[0, 4294967295\]"):
        pool_spec.SidecarSpec.from_pool(hash_seed_pool(bad), default_image="img:1")
    spec = pool_spec.SidecarSpec.from_pool(hash_seed_pool("4294967295"), default_image="img:1")
    assert spec.hash_seed == "4294967295"


@pytest.mark.parametrize("env, said", [
    ([{"name": "PYTHONHASHSEED", "value": "1"}], r"spec\.sidecar\.env\[0\] sets PYTHONHASHSEED.*spec\.hashSeed"),
    ([{"name": "VLLM_P2P_SIDE_CHANNEL_PORT", "value": "1"}], r"env\[0\] sets VLLM_P2P_SIDE_CHANNEL_PORT"),
    ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], r"env\[1\] repeats A"),
    ([{"value": "1"}], r"env\[0\] has no name"),
    ([{"name": "A"}], r"env\[0\] \(A\) needs exactly one of"),
    ("UCX_TLS=tcp", r"spec\.sidecar\.env must be a list"),
])
def test_bad_sidecar_env_is_refused_naming_the_entry(env: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        pool_spec.SidecarSpec.from_pool(hash_seed_pool(env=env), default_image="img:1")


def test_a_pool_whose_connector_config_names_another_hash_seed_is_a_problem() -> None:
    ktc = json.loads(KTC)
    ktc["kv_connector_extra_config"]["hash_seed"] = "9"
    stated = translate(["vllm", "serve", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", json.dumps(ktc)],
                       llama_config())
    problem = pool_spec.pool_hash_seed_problem(stated, "0")
    assert problem is not None and "spec.hashSeed: '9'" in problem
    assert pool_spec.pool_hash_seed_problem(stated, "9") is None
    assert pool_spec.pool_hash_seed_problem(translate(LLAMA_ARGS, llama_config()), "0") is None
    # Beside the secret seed any stated seed is false (the sidecar would state it instead of
    # its PYTHONHASHSEED) and would print a seed into the ConfigMap.
    secret = pool_spec.pool_hash_seed_problem(stated, None)
    assert secret is not None and secret.startswith("kv_connector_extra_config.hash_seed='9' is set but "
                                                    "spec.hashSeed is not")
    assert "remove hash_seed from kv_connector_extra_config, or set spec.hashSeed: '9'" in secret
    assert pool_spec.pool_hash_seed_problem(translate(LLAMA_ARGS, llama_config()), None) is None


def test_without_spec_hash_seed_the_pool_uses_its_secret_seed_which_the_sidecar_states() -> None:
    """The sidecar states extra_config's seed, else its PYTHONHASHSEED: with a secret seed
    (no spec.hashSeed, no stated seed) it states the PYTHONHASHSEED vLLM hashes with."""
    from kv_offload_sidecar.settings import effective_hash_seed

    assert pool_spec.SidecarSpec.from_pool(pool(), default_image="img:1").hash_seed is None
    config = translate(LLAMA_ARGS, llama_config())
    assert pool_spec.pool_hash_seed_problem(config, None) is None
    assert effective_hash_seed(config, {"PYTHONHASHSEED": "3141592653"}) == "3141592653"


def test_tls_needs_a_secret_name_and_the_tcp_transport_which_it_picks_when_none_is_named() -> None:
    tcp = {"transport": "tcp"}
    assert sidecar_spec(dataPlane=tcp, tls={"secretName": "pool-tls"}).tls_secret == "pool-tls"
    assert sidecar_spec(dataPlane=tcp).tls_secret is None
    alone = sidecar_spec(tls={"secretName": "pool-tls"})
    assert (alone.transport, alone.transport_given, alone.tls_secret) == ("tcp", True, "pool-tls")
    with pytest.raises(ValueError) as info:
        sidecar_spec(dataPlane={"transport": "ucx"}, tls={"secretName": "pool-tls"})
    message = str(info.value)
    assert message.startswith("spec.sidecar.tls.secretName='pool-tls' is set but "
                              "spec.sidecar.dataPlane.transport is 'ucx'")
    assert "TLS applies to the tcp transport only and UCX traffic is not encrypted" in message
    assert "set spec.sidecar.dataPlane.transport: tcp" in message
    with pytest.raises(ValueError,
                       match=r"spec\.sidecar\.tls=\{\} names no Secret: set spec\.sidecar\.tls\.secretName"):
        sidecar_spec(dataPlane=tcp, tls={})


def test_prefill_rate_and_peer_copies_default_to_the_operators_and_a_pool_sets_its_own() -> None:
    s = sidecar_spec()
    assert (s.prefill_tokens_per_second, s.peer_copies) == (0.0, "drop")
    operators = pool_spec.SidecarSpec.from_pool(pool(), default_image="i", default_prefill_tokens_per_second=12500.5,
                                                default_peer_copies="cold")
    assert (operators.prefill_tokens_per_second, operators.peer_copies) == (12500.5, "cold")
    own = pool_spec.SidecarSpec.from_pool(pool(prefillTokensPerSecond=8000, peerCopies="drop"), default_image="i",
                                          default_prefill_tokens_per_second=12500.5, default_peer_copies="cold")
    assert (own.prefill_tokens_per_second, own.peer_copies) == (8000.0, "drop")
    assert isinstance(own.prefill_tokens_per_second, float)
    # 0 is a value, not "unset": it always fetches even where the operator's default is a rate.
    zero = pool_spec.SidecarSpec.from_pool(pool(prefillTokensPerSecond=0), default_image="i",
                                           default_prefill_tokens_per_second=12500.5)
    assert zero.prefill_tokens_per_second == 0.0


@pytest.mark.parametrize("bad", [-1, -0.5, "12500", True, float("nan"), float("inf"), None])
def test_a_prefill_rate_that_is_not_a_number_at_least_0_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        sidecar_spec(prefillTokensPerSecond=bad)
    message = str(info.value)
    assert message.startswith(f"spec.sidecar.prefillTokensPerSecond={bad!r}: use a number >= 0"), message
    assert "prompt tokens per second" in message and "0 always fetches" in message


@pytest.mark.parametrize("bad", ["keep", "Drop", "", 1, None])
def test_an_unknown_peer_copies_policy_is_refused_naming_the_field_and_the_choices(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        sidecar_spec(peerCopies=bad)
    message = str(info.value)
    assert message.startswith(f"spec.sidecar.peerCopies={bad!r}: use one of ['drop', 'cold']"), message


def test_the_operators_policy_defaults_are_the_sidecars_own() -> None:
    """A pool that sets nothing and an operator started without the flags run the sidecar's defaults."""
    import argparse

    from kv_offload_sidecar.commands import sidecar as sidecar_main
    from kv_offload_sidecar.setting_flags import flag_fields
    from kv_offload_sidecar.settings import PEER_COPIES, SidecarSettings

    parser = argparse.ArgumentParser()
    sidecar_main.add_arguments(parser)
    flags = parser.parse_args(["--config", "c", "--pool-key-file", "k"])
    fields = {f.name: f.default for f, _ in flag_fields(SidecarSettings)}
    assert pool_spec.DEFAULT_PREFILL_TOKENS_PER_SECOND == flags.prefill_tokens_per_second \
        == fields["prefill_tokens_per_second"] == 0.0
    assert pool_spec.DEFAULT_PEER_COPIES == flags.peer_copies == fields["peer_copies"] == "drop"
    assert pool_spec.DEFAULT_PEER_COPIES in PEER_COPIES


def test_the_nixl_transport_is_accepted_but_not_with_tls_nor_rdma() -> None:
    nixl = {"transport": "nixl"}
    assert sidecar_spec(dataPlane=nixl).transport == "nixl"
    with pytest.raises(ValueError) as info:
        sidecar_spec(dataPlane=nixl, tls={"secretName": "pool-tls"})
    message = str(info.value)
    assert message.startswith("spec.sidecar.tls.secretName='pool-tls' is set but "
                              "spec.sidecar.dataPlane.transport is 'nixl'")
    assert "TLS applies to the tcp transport only" in message
    assert "set spec.sidecar.dataPlane.transport: tcp" in message
    assert "NIXL reads over UCX, which are not encrypted" in message
    with pytest.raises(ValueError, match=r"spec\.sidecar\.rdma is set but spec\.sidecar\.dataPlane\.transport "
                                         r"is 'nixl'"):
        sidecar_spec(dataPlane=nixl, ucxTransports="rdma-rc", rdma={"resources": {"rdma/ib": 1}})


def test_data_plane_is_one_setting_of_transport_and_lanes_defaulted_per_pod_unless_named() -> None:
    unset = sidecar_spec()
    assert (unset.transport, unset.lanes, unset.transport_given, unset.deprecations) == \
        (pool_spec.DEFAULT_TRANSPORT, pool_spec.DEFAULT_LANES, False, ())
    named = sidecar_spec(dataPlane={"transport": "tcp", "lanes": 4})
    assert (named.transport, named.lanes, named.transport_given) == ("tcp", 4, True)
    only_lanes = sidecar_spec(dataPlane={"lanes": 2})
    assert (only_lanes.lanes, only_lanes.transport_given) == (2, False)  # the transport stays the pod's
    rdma = sidecar_spec(ucxTransports="rdma-rc", rdma={"resources": {"rdma/ib": 1}})
    assert (rdma.transport, rdma.transport_given) == ("ucx", True)  # RDMA needs ucx, whatever the pod
    for bad, said in (({"transport": "rdma"}, r"spec\.sidecar\.dataPlane\.transport='rdma': use one of"),
                      ({"lanes": 9}, r"spec\.sidecar\.dataPlane\.lanes=9: use 0 .* or 1-8"),
                      ({"lanes": -1}, r"spec\.sidecar\.dataPlane\.lanes=-1"),
                      ({"lanes": True}, r"spec\.sidecar\.dataPlane\.lanes=True"),
                      ("tcp", r"spec\.sidecar\.dataPlane='tcp' must be an object")):
        with pytest.raises(ValueError, match=said):
            sidecar_spec(dataPlane=bad)


def test_the_operators_data_plane_defaults_apply_to_pools_that_name_none() -> None:
    body = pool()
    s = pool_spec.SidecarSpec.from_pool(body, default_image="i", default_transport="nixl", default_lanes=3)
    assert (s.transport, s.lanes, s.transport_given) == ("nixl", 3, True)
    body["spec"]["sidecar"] = {"dataPlane": {"transport": "tcp", "lanes": 1}}
    s = pool_spec.SidecarSpec.from_pool(body, default_image="i", default_transport="nixl", default_lanes=3)
    assert (s.transport, s.lanes) == ("tcp", 1)


def test_the_old_transport_field_is_still_read_with_a_deprecated_condition() -> None:
    old = sidecar_spec(transport="tcp")
    assert (old.transport, old.transport_given) == ("tcp", True)
    (message,) = old.deprecations
    assert message.startswith("spec.sidecar.transport is deprecated: move it to spec.sidecar.dataPlane.transport")
    (cond,) = pool_spec.deprecation_conditions(old, None, 3, "2026-01-01T00:00:00Z")
    assert (cond["type"], cond["status"], cond["reason"], cond["observedGeneration"]) == \
        ("Deprecated", "True", "DeprecatedField", 3)
    assert cond["message"] == message
    later = pool_spec.deprecation_conditions(old, [cond], 4, "2026-02-01T00:00:00Z")
    assert later[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # the same message: no transition
    assert pool_spec.deprecation_conditions(sidecar_spec(dataPlane={"transport": "tcp"}), [cond], 5, "t") == []
    assert sidecar_spec(transport="tcp", dataPlane={"transport": "tcp", "lanes": 2}).lanes == 2
    with pytest.raises(ValueError, match=r"spec\.sidecar\.transport='ucx' \(deprecated\) and "
                                         r"spec\.sidecar\.dataPlane\.transport='tcp' disagree"):
        sidecar_spec(transport="ucx", dataPlane={"transport": "tcp"})


def test_an_operator_without_a_sidecar_image_refuses_pools_that_name_none_saying_how() -> None:
    assert pool_spec.DEFAULT_SIDECAR_IMAGE == ""  # no public registry holds the image
    with pytest.raises(ValueError) as info:
        pool_spec.SidecarSpec.from_pool(pool(), default_image=pool_spec.DEFAULT_SIDECAR_IMAGE)
    message = str(info.value)
    assert "set spec.sidecar.image" in message and "--sidecar-image" in message and "the chart" in message
    assert sidecar_spec(image="registry.example/kv-offload:1").image == "registry.example/kv-offload:1"


@pytest.mark.parametrize("bad", [0, -5, "600", 1.5, True])
def test_key_rotation_grace_must_be_a_positive_whole_number_of_seconds(bad: Any) -> None:
    body = pool()
    assert pool_spec.key_rotation_grace_seconds(body) == pool_spec.DEFAULT_KEY_ROTATION_GRACE_SECONDS == 600
    body["spec"]["keyRotationGraceSeconds"] = 90
    assert pool_spec.key_rotation_grace_seconds(body) == 90
    body["spec"]["keyRotationGraceSeconds"] = bad
    with pytest.raises(ValueError, match=r"spec\.keyRotationGraceSeconds=.*use a whole number of seconds, at least 60"):
        pool_spec.key_rotation_grace_seconds(body)


def test_crd_is_a_valid_v1alpha1_namespaced_crd_with_status_and_printer_columns(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, K8S, strict=True)
    assert crd["metadata"]["name"] == "kvoffloadpools.kv-offload.io"
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]] == [
        ("Fingerprint", ".status.fingerprint"), ("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        ("Reason", '.status.conditions[?(@.type=="Ready")].reason'), ("Ready Peers", ".status.readyPeers"),
        ("Age", ".metadata.creationTimestamp")]


def test_crd_schema_accepts_a_real_pool_and_rejects_a_bad_transport(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    good = pool_body("llama", sidecar={"transport": "tcp", "basePort": 5710, "capacityBytes": 1 << 30,
                                       "resources": {"limits": {"memory": "2Gi"}}})
    good["spec"]["shmSizeLimit"] = "4Gi"
    good["status"] = {"fingerprint": "ab" * 8, "namespaceDigest": "ab" * 6, "configMap": "c", "readyPeers": 2,
                      "observedGeneration": 1, "conditions": pool_objects.pool_conditions(
                          None, invalid_message=None, generation=1, now="2026-01-01T00:00:00Z")}
    jsonschema.validate(json.loads(json.dumps(good)), schema)
    bad = copy.deepcopy(good)
    bad["spec"]["sidecar"]["transport"] = "rdma"
    with pytest.raises(jsonschema.ValidationError, match="rdma"):
        jsonschema.validate(bad, schema)
    # No default in the CRD: an unset port is the operator's (the chart's sidecar.controlPort / dataPort).
    ports = schema["properties"]["spec"]["properties"]["sidecar"]["properties"]
    assert "default" not in ports["basePort"] and "default" not in ports["dataPort"]
    assert pool_spec.SidecarSpec.from_pool(pool(), default_image="i", default_base_port=6710,
                                           default_data_port=6810).control_port(0) == 6710


def test_crd_schema_admits_nixl_and_the_policy_knobs_and_refuses_bad_values(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    sidecar = schema["properties"]["spec"]["properties"]["sidecar"]
    # Every transport the sidecar (and so pool_spec) accepts, and nothing else.
    assert sorted(sidecar["properties"]["transport"]["enum"]) == sorted(pool_spec.TRANSPORTS)
    plane = sidecar["properties"]["dataPlane"]["properties"]
    assert sorted(plane["transport"]["enum"]) == sorted(pool_spec.TRANSPORTS)
    assert (plane["lanes"]["minimum"], plane["lanes"]["maximum"]) == (0, MAX_DATA_LANES)
    # No defaults: unset is the operator's, else the pod's (tcp beside a GPU), written in pool_spec once.
    assert "default" not in sidecar["properties"]["transport"] and "default" not in plane["transport"]
    assert "default" not in plane["lanes"]
    assert sidecar["properties"]["peerCopies"]["enum"] == list(pool_spec.PEER_COPIES)
    # No default in the CRD: unset means the operator's (the chart's sidecar.prefillTokensPerSecond / peerCopies).
    assert "default" not in sidecar["properties"]["prefillTokensPerSecond"]
    assert "default" not in sidecar["properties"]["peerCopies"]
    for fields in ({"transport": "nixl"}, {"dataPlane": {"transport": "nixl", "lanes": 8}},
                   {"prefillTokensPerSecond": 0}, {"prefillTokensPerSecond": 12500.5},
                   {"peerCopies": "cold", "prefillTokensPerSecond": 8000}):
        jsonschema.validate(pool_body("llama", sidecar=fields), schema)
    for fields, said in (({"prefillTokensPerSecond": -1}, "-1"), ({"prefillTokensPerSecond": "12500"}, "12500"),
                         ({"peerCopies": "keep"}, "keep"), ({"transport": "rdma"}, "rdma"),
                         ({"dataPlane": {"transport": "rdma"}}, "rdma"), ({"dataPlane": {"lanes": 9}}, "9")):
        with pytest.raises(jsonschema.ValidationError, match=said):
            jsonschema.validate(pool_body("llama", sidecar=fields), schema)
    # TLS only with tcp, so nixl with TLS too is refused by the API server (CEL, which jsonschema does not run).
    rule, agree = sidecar["x-kubernetes-validations"]
    assert "self.dataPlane.transport == 'tcp'" in rule["rule"] and "self.transport == 'tcp'" in rule["rule"]
    assert "nixl" in " ".join(rule["message"].split())
    assert agree["rule"].endswith("self.dataPlane.transport == self.transport")


def test_crd_schema_leaves_hash_seed_unset_by_default_and_accepts_sidecar_env(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_props = schema["properties"]["spec"]["properties"]
    assert "default" not in spec_props["hashSeed"]  # unset means the pool's secret seed
    description = " ".join(spec_props["hashSeed"]["description"].split())
    assert "PYTHONHASHSEED" in description and "hash-seed" in description
    assert "anyone who can guess a fixed seed can compute a pool's chunk keys from prompts" in description
    assert "UCX_TLS=tcp,sm,self" in spec_props["sidecar"]["properties"]["env"]["description"]
    good = hash_seed_pool("17", env=[{"name": "UCX_TLS", "value": "tcp,self"},
                                     {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}])
    jsonschema.validate(good, schema)
    for bad_seed in ("seventeen", 17, "12345678901"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(hash_seed_pool(bad_seed), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(hash_seed_pool(env=[{"value": "no name"}]), schema)


def test_control_ports_follow_the_sidecars_rule_and_a_port_above_65535_names_base_port() -> None:
    spec = sidecar_spec(basePort=65000)
    assert [spec.control_port(i) for i in (0, 1, 535)] == [65000, 65001, 65535]
    with pytest.raises(ValueError, match=r"spec\.sidecar\.basePort=65000 \+ data-parallel index 536"):
        spec.control_port(536)


def test_crd_schema_admits_tls_and_the_rotation_grace_and_refuses_a_short_grace(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_props = schema["properties"]["spec"]["properties"]
    grace = spec_props["keyRotationGraceSeconds"]
    assert (grace["default"], grace["minimum"]) == (pool_spec.DEFAULT_KEY_ROTATION_GRACE_SECONDS, 60)
    good = pool_body("llama", sidecar={"dataPlane": {"transport": "tcp"}, "tls": {"secretName": "llama-tls"}})
    good["spec"]["keyRotationGraceSeconds"] = 120
    jsonschema.validate(good, schema)
    for bad_grace in (59, "600"):
        bad = copy.deepcopy(good)
        bad["spec"]["keyRotationGraceSeconds"] = bad_grace
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    for bad_tls in ({}, {"secretName": ""}):
        bad = copy.deepcopy(good)
        bad["spec"]["sidecar"]["tls"] = bad_tls
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # The API server refuses TLS with UCX itself (a CEL rule jsonschema does not run).
    rule, _ = spec_props["sidecar"]["x-kubernetes-validations"]
    assert rule["rule"] == ("!has(self.tls) || ((!has(self.transport) || self.transport == 'tcp') && "
                            "(!has(self.dataPlane) || !has(self.dataPlane.transport) || "
                            "self.dataPlane.transport == 'tcp'))")
    assert "tcp transport only and UCX traffic is not encrypted" in " ".join(rule["message"].split())


def test_crd_status_schema_keeps_the_key_rotation_the_operator_writes(crd: dict[str, Any]) -> None:
    """A structural schema prunes undeclared status fields: keyRotation must be declared."""
    from kv_offload_operator.pools import key_rotation

    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    declared = schema["properties"]["status"]["properties"]["keyRotation"]["properties"]
    body = pool()
    for phase in (key_rotation.ROTATING, key_rotation.DONE):
        status = {"requested": "2026-01", "phase": phase, "since": "2026-01-01T00:00:00Z",
                  "previousKeyExpires": "2026-01-01T00:10:00Z"}
        assert set(status) <= set(declared)
        body["status"] = {"keyRotation": status}
        jsonschema.validate(body, schema)


def test_an_engine_metrics_url_reaches_the_spec_and_a_bad_one_is_refused_naming_the_field() -> None:
    assert sidecar_spec().engine_metrics_url == ""
    url = "http://127.0.0.1:8000/metrics"
    assert sidecar_spec(engineMetricsURL=url).engine_metrics_url == url
    for bad in ("127.0.0.1:8000/metrics", 8000):
        with pytest.raises(ValueError, match=r"spec.sidecar.engineMetricsURL=.*http\(s\) URL"):
            sidecar_spec(engineMetricsURL=bad)


def test_crd_schema_takes_an_engine_metrics_url_and_refuses_a_bare_address(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(pool_body("llama", sidecar={"engineMetricsURL": "http://127.0.0.1:8000/metrics"}), schema)
    with pytest.raises(jsonschema.ValidationError, match="127.0.0.1:8000"):
        jsonschema.validate(pool_body("llama", sidecar={"engineMetricsURL": "127.0.0.1:8000"}), schema)
