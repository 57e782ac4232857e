"""Sizes, ports, probes, UCX presets and RDMA of a pool's sidecar, without a cluster
(quantity.py, pool_spec.py, pod_host.py, pod_patch.py) and the CRD fields that carry them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kv_offload_operator import quantity
from kv_offload_operator.pools import pool_objects, pool_spec
from kv_offload_operator.webhook import pod_host
from kv_offload_operator.webhook import pod_patch as pods
from kv_offload_operator.translation.translate import pool_config
from operator_harness import LLAMA_ARGS, llama_config, pool_body
from pool_support import K8S, inject, injected_env, pod, sidecar_spec, vllm

CRD_PATH = Path(__file__).parents[2] / "charts" / "kv-offload" / "files" / "crd-kvoffloadpools.yaml"
GI = 1 << 30


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("text, size", [
    ("16Gi", 16 * GI), ("500M", 500_000_000), ("1.5Gi", 3 * GI // 2), ("17179869184", 17179869184),
    (17179869184, 17179869184), ("1e3", 1000), ("128Ki", 131072), ("1k", 1000), ("0.5", 1)])
def test_quantities_are_read_as_the_api_server_reads_them(text: Any, size: int) -> None:
    assert quantity.parse_bytes(text, "f") == size


@pytest.mark.parametrize("bad", ["16 GiB", "16GB", "lots", "", "Gi", 1.5, True, None])
def test_a_bad_quantity_is_refused_naming_the_field_and_the_value(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        quantity.parse_bytes(bad, "spec.sidecar.capacityBytes")
    assert str(info.value).startswith(f"spec.sidecar.capacityBytes={bad!r}")
    assert "16Gi" in str(info.value)


def test_format_bytes_is_exact_and_short() -> None:
    assert [quantity.format_bytes(n) for n in (16 * GI, 16 * GI + (256 << 20), 1000, 3 * GI // 2)] == \
        ["16Gi", "16640Mi", "1000", "1536Mi"]


def test_capacity_bytes_takes_a_quantity_and_the_memory_request_covers_the_store() -> None:
    s = sidecar_spec(capacityBytes="16Gi")
    assert s.capacity_bytes == 16 * GI
    assert s.resources == {"requests": {"memory": "16640Mi", "cpu": "250m"}}
    # Own resources are kept; a memory request is added when none is given.
    own = sidecar_spec(capacityBytes="2Gi", resources={"requests": {"cpu": "1"}})
    assert own.resources == {"requests": {"cpu": "1", "memory": "2304Mi"}}
    # A limit alone is the request too (Kubernetes defaults one to the other): nothing added.
    limited = sidecar_spec(capacityBytes="2Gi", resources={"limits": {"memory": "3Gi"}})
    assert limited.resources == {"limits": {"memory": "3Gi"}}
    with pytest.raises(ValueError, match=r"^spec\.sidecar\.capacityBytes='16 GB' is not a Kubernetes quantity"):
        sidecar_spec(capacityBytes="16 GB")
    with pytest.raises(ValueError, match=r"^spec\.sidecar\.capacityBytes='0': set a positive size"):
        sidecar_spec(capacityBytes="0")


@pytest.mark.parametrize("kind", ["requests", "limits"])
def test_a_memory_request_or_limit_below_the_store_is_refused_with_the_size_it_needs(kind: str) -> None:
    with pytest.raises(ValueError) as info:
        sidecar_spec(capacityBytes="16Gi", resources={kind: {"memory": "8Gi"}})
    assert str(info.value) == (
        f"spec.sidecar.resources.{kind}.memory='8Gi' is below the store it holds: spec.sidecar.capacityBytes "
        f"(16Gi) + 256Mi for the process = 16640Mi; raise it to at least 16640Mi or lower spec.sidecar.capacityBytes")


def test_the_data_port_is_the_pools_own_and_may_not_sit_among_its_control_ports() -> None:
    assert sidecar_spec(dataPort=6000).data_port == 6000
    with pytest.raises(ValueError, match=r"spec\.sidecar\.dataPort=70000: use a port in \[1, 65535\]"):
        sidecar_spec(dataPort=70000)
    with pytest.raises(ValueError, match=r"spec\.sidecar\.dataPort=5710 equals spec\.sidecar\.basePort"):
        sidecar_spec(dataPort=5710)
    dp4 = pool_config([*LLAMA_ARGS, "--data-parallel-size", "4"], llama_config())
    assert pool_objects.pool_ports(dp4, sidecar_spec(dataPort=5714))["kvo-data"] == 5714
    with pytest.raises(ValueError) as info:
        pool_objects.pool_ports(dp4, sidecar_spec(dataPort=5712))
    assert str(info.value) == ("spec.sidecar.dataPort=5712 lies among the control ports 5710-5713 "
                               "(spec.sidecar.basePort + data-parallel index, 4 ranks): move spec.sidecar.dataPort "
                               "out of that range")


def test_an_explicit_shm_size_limit_must_hold_the_store_and_vllms_primary_tier() -> None:
    with pytest.raises(ValueError,
                       match=r"spec\.shmSizeLimit='2Gi' \(2Gi\) is smaller than spec\.sidecar\.capacityBytes"):
        pool_spec.SidecarSpec.from_pool({"spec": {"shmSizeLimit": "2Gi", "sidecar": {"capacityBytes": "4Gi"}}},
                                        default_image="img")
    spec = pool_spec.SidecarSpec.from_pool({"spec": {"shmSizeLimit": "12Gi", "sidecar": {"capacityBytes": "4Gi"}}},
                                           default_image="img")
    assert spec.shm_size_limit == 12 * GI
    assert pod_host.shm_size_limit(spec, 4 * GI, 2) == 12 * GI
    with pytest.raises(ValueError) as info:
        pod_host.shm_size_limit(spec, 8 * GI, 2)  # the store + two engines' 8 GiB primary tiers
    assert str(info.value) == (
        "spec.shmSizeLimit (12Gi) cannot hold the sidecar's store (spec.sidecar.capacityBytes 4Gi) and vLLM's "
        "primary tier (2 x cpu_bytes_to_use 8Gi) in /dev/shm: raise spec.shmSizeLimit to at least 21Gi or remove it")
    default = sidecar_spec(capacityBytes="4Gi")
    assert pod_host.shm_size_limit(default, 10 * GI, 2) == 4 * GI + 20 * GI + GI


def test_primary_tier_bytes_come_from_the_vllm_command_line() -> None:
    assert pod_host.primary_tier_bytes(LLAMA_ARGS) == 10 * GI  # KTC's cpu_bytes_to_use
    assert pod_host.primary_tier_bytes(["vllm", "serve", "m", "--kv-offloading-size", "2.5"]) == 5 * GI // 2
    assert pod_host.primary_tier_bytes(["vllm", "serve", "m"]) == 0


def test_the_sidecar_has_only_a_liveness_probe_so_it_never_holds_vllm_back() -> None:
    sidecar = inject(pod(vllm()), capacityBytes="16Gi")["spec"]["initContainers"][1]
    # No readiness probe (never out of the Service), no startup probe (vLLM never waits for it).
    assert "readinessProbe" not in sidecar and "startupProbe" not in sidecar
    liveness = sidecar["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": 5710}
    # Counted once the store is pre-faulted: a minute plus a second per GiB of store.
    assert liveness["initialDelaySeconds"] == 60 + 16
    assert liveness["periodSeconds"] * liveness["failureThreshold"] == 60  # a minute before a restart


@pytest.mark.parametrize("preset, tls", [("tcp-sm", "tcp,sm,self"), ("tcp", "tcp,self"),
                                         ("rdma-rc", "rc,sm,self,tcp"), ("rdma-dc", "dc,sm,self,tcp")])
def test_ucx_transport_presets_set_ucx_tls_and_an_own_ucx_tls_wins(preset: str, tls: str) -> None:
    sidecar = inject(pod(vllm()), ucxTransports=preset)["spec"]["initContainers"][1]
    assert {e["name"]: e.get("value") for e in sidecar["env"]}["UCX_TLS"] == tls
    own = sidecar_spec(ucxTransports=preset, env=[{"name": "UCX_TLS", "value": "ud,self"}])
    assert pods.effective_ucx_tls(own) == "ud,self"
    with pytest.raises(ValueError, match=r"spec\.sidecar\.ucxTransports='verbs': use one of"):
        sidecar_spec(ucxTransports="verbs")


@pytest.mark.parametrize("spec, said", [
    ({"dataPlane": {"transport": "tcp"}, "rdma": {}},
     r"spec\.sidecar\.rdma is set but spec\.sidecar\.dataPlane\.transport is 'tcp'"),
    ({"rdma": {}}, r"spec\.sidecar\.rdma is set but spec\.sidecar\.ucxTransports is 'tcp-sm'.*rdma-rc"),
    ({"ucxTransports": "rdma-rc", "rdma": {"resources": {"ib": 1}}},
     r"spec\.sidecar\.rdma\.resources names 'ib': give a device-plugin resource with its domain"),
    ({"ucxTransports": "rdma-rc", "rdma": {"resources": {"rdma/ib": "two"}}},
     r"spec\.sidecar\.rdma\.resources\.rdma/ib='two': give a whole number of devices"),
    ({"ucxTransports": "rdma-rc", "rdma": {"resourceClaims": [{"name": "nic"}]}},
     r"spec\.sidecar\.rdma\.resourceClaims\[0\]=.*exactly one of resourceClaimName or resourceClaimTemplateName"),
])
def test_rdma_settings_that_cannot_work_are_refused_naming_the_field(spec: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        sidecar_spec(**spec)


def test_an_rdma_pod_is_valid_for_kubernetes_with_devices_claims_and_ipc_lock() -> None:
    out = inject(pod(vllm()), ucxTransports="rdma-dc",
                 rdma={"resources": {"rdma/hca_shared_devices_a": "1"},
                       "resourceClaims": [{"name": "nic", "resourceClaimName": "node-nic", "request": "vf"}],
                       "ipcLock": True})
    kubernetes_validate.validate(out, K8S, strict=True)
    sidecar = out["spec"]["initContainers"][1]
    assert sidecar["resources"]["limits"] == {"rdma/hca_shared_devices_a": "1"}
    assert sidecar["resources"]["claims"] == [{"name": "nic", "request": "vf"}]
    assert out["spec"]["resourceClaims"] == [{"name": "nic", "resourceClaimName": "node-nic"}]
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert (sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsNonRoot"]) == (0, False)
    plain = inject(pod(vllm()), ucxTransports="rdma-rc", rdma={"resources": {"rdma/ib": 1}})
    assert plain["spec"]["initContainers"][1]["securityContext"] == dict(pods.CONTAINER_SECURITY)  # non-root
    # A pod that already has the claim keeps one entry; another claim of that name is refused.
    same = pod(vllm())
    same["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimName": "node-nic"}]
    again = inject(same, ucxTransports="rdma-rc",
                   rdma={"resourceClaims": [{"name": "nic", "resourceClaimName": "node-nic"}]})
    assert again["spec"]["resourceClaims"] == [{"name": "nic", "resourceClaimName": "node-nic"}]
    other = pod(vllm())
    other["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimName": "gpu"}]
    with pytest.raises(ValueError, match=r"the pod's resourceClaims already has 'nic'"):
        inject(other, ucxTransports="rdma-rc", rdma={"resourceClaims": [{"name": "nic", "resourceClaimName": "x"}]})


def test_the_crd_takes_the_new_fields_as_int_or_string_the_way_the_api_server_allows(schema: dict[str, Any]) -> None:
    spec_props = schema["properties"]["spec"]["properties"]
    sidecar_props = spec_props["sidecar"]["properties"]
    for prop in (sidecar_props["capacityBytes"], spec_props["injectKVTransferConfig"]["properties"]["cpuBytesToUse"]):
        # A structural schema allows exactly this anyOf beside x-kubernetes-int-or-string.
        assert prop["anyOf"] == [{"type": "integer"}, {"type": "string"}] and prop["x-kubernetes-int-or-string"]
        (rule,) = prop["x-kubernetes-validations"]
        pattern = re.search(r"matches\('([^']*)'\)", rule["rule"])
        assert pattern is not None and pattern.group(1) == quantity.QUANTITY_PATTERN
        for good in ("16Gi", "500M", "1.5Gi", "17179869184"):
            assert re.fullmatch(pattern.group(1), good)
        for bad in ("16 GiB", "-1", "1.5.1Gi"):
            assert not re.fullmatch(pattern.group(1), bad)
    body = pool_body("llama", sidecar={"capacityBytes": "16Gi", "dataPort": 6810, "ucxTransports": "rdma-rc",
                                       "rdma": {"resources": {"rdma/ib": 1}, "ipcLock": True,
                                                "resourceClaims": [{"name": "nic", "resourceClaimTemplateName": "t"}]}})
    jsonschema.validate(body, schema)
    for bad in ({"ucxTransports": "verbs"}, {"dataPort": 0}, {"rdma": {"ipcLock": "yes"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(pool_body("llama", sidecar=bad), schema)


def test_printer_columns_show_ready_and_reason_from_the_ready_condition() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    status = {"conditions": pool_objects.pool_conditions(None, invalid_message=None, generation=1,
                                                         now="2026-01-01T00:00:00Z",
                                                         waiting_message="ConfigMap 'x' does not exist")}

    def evaluate(path: str) -> Any:  # the one JSONPath filter form the columns use
        match = re.fullmatch(r'\.status\.conditions\[\?\(@\.type=="(\w+)"\)\]\.(\w+)', path)
        assert match is not None, path
        return next(c[match.group(2)] for c in status["conditions"] if c["type"] == match.group(1))

    assert (evaluate(columns["Ready"]), evaluate(columns["Reason"])) == ("False", "Waiting")


@pytest.mark.timeout(240)
def test_real_ucx_sidecars_with_the_rdma_preset_refuse_a_ucx_built_without_rdma_saying_what_to_change() -> None:
    """The env an rdma-rc pool injects (UCX_TLS=rc,sm,self,tcp), in a real sidecar process whose
    UCX (the ucxx wheel's, as in an image built without a UCX source) has no rc compiled in:
    the sidecar exits 2 with one line naming the missing transport and how to build the image
    with RDMA, rather than running without the RDMA the pool asked for. (With rc compiled in
    and no RDMA device on the node, UCX leaves rc out and uses the rest; no such UCX is here.)"""
    from kv_offload_testing.local_pool import LocalPool, example_config

    spec = sidecar_spec(ucxTransports="rdma-rc", rdma={"resources": {"rdma/ib": 1}})
    injected = injected_env(spec)
    assert injected["UCX_TLS"] == "rc,sm,self,tcp"
    injected["PYTHONHASHSEED"] = "4321"
    pool = LocalPool(1, transport="ucx", capacity_bytes=64 * example_config().kv_bytes_per_chunk, env=injected)
    with pytest.raises(RuntimeError, match=r"exited with code 2:[\s\S]*UCX_TLS='rc,sm,self,tcp' asks for rc, "
                       r"which the UCX this sidecar runs .* was built without .*UCX_TARBALL"):
        with pool:
            pass
