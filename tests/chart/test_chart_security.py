"""The chart's security pieces: Secret RBAC, the TLS pool example and the README's Security section."""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema
import yaml
from chart_support import CHART, FULLNAME, REPO, find, load_documents
from kv_offload_operator.pools import key_rotation, pool_objects, pool_spec
from kv_offload_operator.webhook import pod_patch
from kv_offload_operator.cli import operator as operator_main
from kv_offload_operator.translation.translate import translate

TLS_EXAMPLE = CHART / "examples" / "manifests" / "pool-tls-cert-manager.yaml"


def _objects(kind: str, objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_the_operator_may_patch_secrets_but_never_list_watch_replace_or_delete_them(render):
    (rule,) = [r for r in find(render(), "ClusterRole", FULLNAME)["rules"] if "secrets" in r["resources"]]
    assert rule["resources"] == ["secrets"] and rule["apiGroups"] == [""]
    assert sorted(rule["verbs"]) == ["create", "get", "patch"]


def test_tls_example_chains_a_self_signed_issuer_to_the_pool_certificate_the_pool_names():
    objects = load_documents(TLS_EXAMPLE.read_text())
    issuers, certificates = _objects("Issuer", objects), _objects("Certificate", objects)
    (pool,) = [o for o in objects if o["kind"] == "KVOffloadPool"]
    namespace = pool["metadata"]["namespace"]
    assert {o["metadata"]["namespace"] for o in objects} == {namespace}

    secret = pool["spec"]["sidecar"]["tls"]["secretName"]
    (leaf,) = [c for c in certificates.values() if c["spec"]["secretName"] == secret]
    assert {"server auth", "client auth"} <= set(leaf["spec"]["usages"])  # mutual TLS, both roles
    assert not leaf["spec"].get("isCA")
    ca_issuer = issuers[leaf["spec"]["issuerRef"]["name"]]
    assert leaf["spec"]["issuerRef"]["kind"] == "Issuer"
    (ca,) = [c for c in certificates.values() if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}


def test_tls_example_pool_is_valid_for_the_crd_and_the_operator_and_gets_the_certificate_mounted():
    objects = load_documents(TLS_EXAMPLE.read_text())
    (pool,) = [o for o in objects if o["kind"] == "KVOffloadPool"]
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    jsonschema.validate(pool, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    spec = pool_spec.SidecarSpec.from_pool(pool, default_image="kv-offload:test")
    assert (spec.transport, spec.tls_secret) == ("tcp", pool["spec"]["sidecar"]["tls"]["secretName"])
    model_config = json.loads((REPO / "tests" / "operator" / "fixtures" / "llama-3.1-8b.json").read_text())
    assert len(translate(pool["spec"]["vllmArgs"], model_config).fingerprint) == 16
    volumes = {v["name"]: v for v in pod_patch.pod_volumes(pool["metadata"]["name"], spec, with_shm=True)}
    assert volumes[pod_patch.TLS_VOLUME]["secret"]["secretName"] == spec.tls_secret


def test_readme_security_section_says_what_the_secret_holds_and_how_to_rotate_and_authenticate():
    readme = (CHART / "README.md").read_text()
    section = " ".join(readme.split("## Security", 1)[1].split("\n## ", 1)[0].split())
    for key in (pool_objects.POOL_KEY_KEY, pool_objects.PREVIOUS_KEY_KEY, pool_objects.HASH_SEED_KEY,
                pool_objects.ADMIN_TOKEN_KEY):
        assert f"`{key}`" in section
    assert key_rotation.ROTATE_ANNOTATION in section and key_rotation.ROTATED_FOR_ANNOTATION in section
    assert "spec.keyRotationGraceSeconds" in section and "(default 600, at least 60)" in section
    assert "kubectl -n inference get secret llama-8b-pool-key -o jsonpath='{.data.admin-token}' | base64 -d" \
        in section
    assert 'Authorization: Bearer $TOKEN' in section
    for endpoint in ("/v1/status", "/v1/peers", "/v1/lookup"):
        assert endpoint in section
    assert "spec.sidecar.tls.secretName" in section and "cert-manager" in section
    assert "UCX and RDMA are not encrypted" in section and "NetworkPolicy" in section
    # The flag the README names is the operator's.
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    assert "--key-rotation-check-seconds" in section
    assert parser.parse_args(["-A"]).key_rotation_check_seconds == 10.0
