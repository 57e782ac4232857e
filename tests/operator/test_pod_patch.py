"""The webhook's mutation of a pod (pod_patch.py), without a cluster."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
from kv_offload_operator.webhook import pod_patch as pods
from kv_offload_operator.pools import pool_objects, pool_pod, pool_spec
from kv_offload_operator.translation.translate import pool_config
from kv_offload_sidecar.cpu_budget import CPU_REQUEST_ENV, read_cpu_budget
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from operator_harness import KTC, LLAMA_ARGS, llama_config
from pool_support import (
    K8S,
    assert_ucx_sidecars_share_chunks,
    env_of,
    hash_seed_pool,
    inject,
    inject_into,
    injected_env,
    pod,
    pool,
    sidecar_spec,
    vllm,
)


@pytest.fixture(scope="module")
def config() -> OffloadingConfig:
    return pool_config(LLAMA_ARGS, llama_config())


def test_injection_is_idempotent_and_marks_the_pod_with_the_fingerprint() -> None:
    once = inject(pod(vllm()))
    assert once["metadata"]["annotations"][pool_pod.INJECTED_ANNOTATION] == "abcd" * 4
    assert pods.pod_patch(once, pool(), fingerprint="ffff" * 4, sidecar=sidecar_spec()) == []
    kubernetes_validate.validate(once, K8S, strict=True)


def test_user_init_containers_env_and_pythonpath_are_kept() -> None:
    user_init = {"name": "fetch-weights", "image": "busybox", "command": ["true"]}
    p = pod(vllm(env=[{"name": "PYTHONPATH", "value": "/opt/extra"},
                      {"name": "VLLM_P2P_SIDE_CHANNEL_PORT", "value": "1"}]))
    p["spec"]["initContainers"] = [user_init]
    out = inject(p)
    assert [c["name"] for c in out["spec"]["initContainers"]] == \
        ["fetch-weights", pods.TIER_INIT_NAME, pool_pod.SIDECAR_NAME]
    env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
    assert env["PYTHONPATH"] == "/kv-offload-lib:/opt/extra"
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "5710"  # ours wins over a stale value
    names = [e["name"] for e in out["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))


def test_pythonpath_from_value_from_is_refused_with_what_to_change() -> None:
    p = pod(vllm(env=[{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]))
    with pytest.raises(ValueError, match="PYTHONPATH with valueFrom"):
        inject(p)


def test_the_vllm_container_is_found_among_others_or_named_by_annotation() -> None:
    proxy = {"name": "proxy", "image": "envoy", "args": ["--config", "/etc/envoy.yaml"]}
    api_server = {"name": "engine", "image": "vllm/vllm-openai:v0.34.0",
                  "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                  "args": ["--model", "meta-llama/Llama-3.1-8B", "--kv-transfer-config", KTC]}
    out = inject(pod(proxy, api_server))
    assert "env" not in out["spec"]["containers"][0]
    assert {e["name"] for e in out["spec"]["containers"][1]["env"]} >= {"VLLM_P2P_SIDE_CHANNEL_HOST", "PYTHONPATH"}

    two = pod(vllm(), dict(vllm(), name="vllm-2"))
    with pytest.raises(ValueError, match=r"set annotation kv-offload.io/vllm-container"):
        inject(two)
    annotations = {pool_pod.VLLM_CONTAINER_ANNOTATION: "vllm-2"}
    named = inject(dict(two, metadata=dict(two["metadata"], annotations=annotations)))
    assert "env" not in named["spec"]["containers"][0] and "env" in named["spec"]["containers"][1]


def test_dp_ranks_come_from_the_pods_own_args() -> None:
    args = ["serve", "m", "--data-parallel-size", "8", "--data-parallel-rank", "5", "--kv-transfer-config", KTC]
    out = inject(pod(vllm(args)), basePort=7000)
    sidecar = out["spec"]["initContainers"][1]
    assert [p["containerPort"] for p in sidecar["ports"]] == [7005, 5810]
    assert sidecar["livenessProbe"]["httpGet"]["port"] == 7005
    env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "7000"  # base; the tier adds its DP index


def test_unparsable_vllm_args_are_refused_naming_the_container() -> None:
    with pytest.raises(ValueError, match=r"container 'vllm'.*--data-parallel-size"):
        inject(pod(vllm(["serve", "m", "--data-parallel-size", "many"])))


def test_apply_patch_agrees_with_an_independent_rfc6902_implementation() -> None:
    p = pod(vllm(volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}]))
    p["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    ops = pods.pod_patch(p, pool(), fingerprint="f" * 16, sidecar=sidecar_spec())
    ours = copy.deepcopy(p)
    pods.apply_patch(ours, ops)
    assert ours == jsonpatch.JsonPatch(ops).apply(copy.deepcopy(p))


def test_a_pod_translating_to_another_fingerprint_is_named_with_its_field_diff(config: OffloadingConfig) -> None:
    same = pod(vllm(["serve", "meta-llama/Llama-3.1-8B", "--port", "8000", "--block-size", "16",
                     "--kv-transfer-config", KTC]))
    assert pods.pod_identity_problem(same, config, llama_config()) is None
    other = pod(vllm(["serve", "meta-llama/Llama-3.1-8B", "--block-size", "32", "--kv-transfer-config", KTC]))
    problem = pods.pod_identity_problem(other, config, llama_config())
    assert problem is not None and config.fingerprint in problem and "tokens_per_block" in problem
    with pytest.raises(ValueError, match="no KV offloading connector"):
        pods.pod_identity_problem(pod(vllm(["serve", "meta-llama/Llama-3.1-8B"])), config, llama_config())


def test_a_pod_declaring_another_model_identity_is_named_with_the_declared_field_diff(
        config: OffloadingConfig) -> None:
    line = ["serve", "meta-llama/Llama-3.1-8B", "--block-size", "16", "--kv-transfer-config", KTC]
    declared = {"revision": "abc123", "block_size": "16"}
    same = pod(vllm([*line, "--revision", "abc123", "--port", "8000", "--max-num-seqs", "8"]))
    assert pods.pod_identity_problem(same, config, llama_config(), declared=declared) is None
    other = pod(vllm([*line, "--revision", "def456"]))
    problem = pods.pod_identity_problem(other, config, llama_config(), declared=declared)
    assert problem is not None
    assert 'model_identity.revision: "abc123" != "def456"' in problem
    assert pods.pod_identity_problem(other, config, llama_config()) is None  # no pool identity given


def resolved_env(container: dict[str, Any], secret: dict[str, Any]) -> dict[str, str]:
    """A container's env as the kubelet gives it: plain values, and secretKeyRefs into ``secret``."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if "value" in e:
            env[e["name"]] = e["value"]
        elif ref is not None:
            assert ref["name"] == secret["metadata"]["name"]
            env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


@pytest.mark.parametrize("seed", [None, "1234"])
def test_vllm_and_sidecar_get_the_pools_hash_seed_which_the_sidecar_states_in_its_handshake(seed: str | None) -> None:
    from kv_offload_sidecar.settings import effective_hash_seed

    body = hash_seed_pool(seed)
    out = inject_into(body, pod(vllm()))
    secret = pool_objects.pool_key_secret(body, b"k" * 32)
    wanted = seed or base64.b64decode(secret["data"]["hash-seed"]).decode()
    vllm_env = resolved_env(out["spec"]["containers"][0], secret)
    sidecar_env = resolved_env(out["spec"]["initContainers"][1], secret)
    assert vllm_env["PYTHONHASHSEED"] == sidecar_env["PYTHONHASHSEED"] == wanted
    # What the sidecar process derives from that environment and the pool's config.
    config = pool_config(LLAMA_ARGS, llama_config())
    assert effective_hash_seed(config, sidecar_env) == wanted
    kubernetes_validate.validate(out, K8S, strict=True)


@pytest.mark.parametrize("resources, cpus", [
    (None, 1),  # the default request, 250m: one core
    ({"requests": {"cpu": "2500m"}}, 2),
    ({"requests": {"cpu": "3"}, "limits": {"memory": "16Gi"}}, 3),
])
def test_the_sidecar_gets_its_cpu_request_through_the_downward_api_and_sizes_its_threads_by_it(
        tmp_path: Path, resources: dict[str, Any] | None, cpus: int) -> None:
    out = inject_into(hash_seed_pool(**({"resources": resources} if resources else {})), pod(vllm()), validate=True)
    sidecar = out["spec"]["initContainers"][1]
    assert env_of(sidecar)[CPU_REQUEST_ENV] == {"resourceFieldRef": {
        "containerName": sidecar["name"], "resource": "requests.cpu", "divisor": "1m"}}
    # As the kubelet resolves it: the named container's request in divisors (millicores).
    given = sidecar["resources"]["requests"]["cpu"]
    millicores = int(given[:-1]) if given.endswith("m") else int(given) * 1000
    # What the sidecar makes of it where no cgroup sets a limit.
    budget = read_cpu_budget(tmp_path / "proc", tmp_path / "cgroup", environ={CPU_REQUEST_ENV: str(millicores)},
                             affinity=8)
    assert (budget.cpus, budget.source) == (cpus, f"CPU request {millicores}m ({CPU_REQUEST_ENV})")


def test_spec_sidecar_env_may_not_set_the_cpu_request_the_webhook_passes() -> None:
    with pytest.raises(ValueError, match=rf"spec\.sidecar\.env\[0\] sets {CPU_REQUEST_ENV}, which the operator "
                       r"sets itself: remove it and use spec\.sidecar\.resources\.requests\.cpu instead"):
        sidecar_spec(env=[{"name": CPU_REQUEST_ENV, "value": "4000"}])


def test_without_spec_hash_seed_the_seed_comes_from_the_pool_secret_and_is_nowhere_in_the_pod_spec() -> None:
    out = inject_into(hash_seed_pool(), pod(vllm()))
    ref = {"secretKeyRef": {"name": "llama-pool-key", "key": "hash-seed", "optional": True}}
    assert env_of(out["spec"]["containers"][0])["PYTHONHASHSEED"] == ref
    assert env_of(out["spec"]["initContainers"][1])["PYTHONHASHSEED"] == ref
    assert "--hash-seed" not in out["spec"]["initContainers"][1]["args"]


def test_a_vllm_container_already_setting_the_pools_seed_keeps_one_entry() -> None:
    out = inject_into(hash_seed_pool("42"), pod(vllm(env=[{"name": "PYTHONHASHSEED", "value": "42"}])))
    assert env_of(out["spec"]["containers"][0])["PYTHONHASHSEED"] == "42"
    script = f"PYTHONHASHSEED=42 vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{KTC}'"
    out = inject_into(hash_seed_pool("42"), pod(vllm(command=["/bin/sh", "-c"], args=[script])))
    assert env_of(out["spec"]["containers"][0])["PYTHONHASHSEED"] == "42"


# The hash seed a container sets must be the pool's: a pool whose seed is a secret (no
# spec.hashSeed) refuses any, a pool with spec.hashSeed another; each error says how to fix it.
SECRET_SEED = ("but the pool has no spec.hashSeed", "Secret 'llama-pool-key', key 'hash-seed'",
               "remove PYTHONHASHSEED from the container, or set spec.hashSeed on the pool")
OTHER_SEED = ("spec.hashSeed is '0'", "remove PYTHONHASHSEED", "spec.hashSeed: '7'")


@pytest.mark.parametrize("seed, container, said, fix", [
    (None, vllm(env=[{"name": "PYTHONHASHSEED", "value": "0"}]), "sets PYTHONHASHSEED='0'", SECRET_SEED),
    (None, vllm(env=[{"name": "PYTHONHASHSEED", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}]),
     "sets PYTHONHASHSEED with valueFrom", SECRET_SEED),
    (None, vllm(command=["/bin/sh", "-c"], args=[
        f"PYTHONHASHSEED=0 vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{KTC}'"]),
     "command line sets PYTHONHASHSEED='0'", SECRET_SEED),
    ("0", vllm(env=[{"name": "PYTHONHASHSEED", "value": "7"}]), "sets PYTHONHASHSEED='7'", OTHER_SEED),
    ("0", vllm(command=["/bin/sh", "-c"], args=[
        f"PYTHONHASHSEED=7 vllm serve meta-llama/Llama-3.1-8B --kv-transfer-config '{KTC}'"]),
     "command line sets PYTHONHASHSEED='7'", OTHER_SEED),
])
def test_a_vllm_container_setting_a_hash_seed_other_than_the_pools_is_refused_saying_how_to_fix_it(
        seed: str | None, container: dict[str, Any], said: str, fix: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:
        inject_into(hash_seed_pool(seed), pod(container))
    message = str(info.value)
    assert message.startswith("the vLLM container") and said in message
    assert all(part in message for part in fix), message


def test_a_hash_seed_from_value_from_is_refused_because_it_cannot_be_checked() -> None:
    container = vllm(env=[{"name": "PYTHONHASHSEED", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}])
    with pytest.raises(ValueError, match="PYTHONHASHSEED with valueFrom, so it cannot be checked"):
        inject_into(hash_seed_pool("0"), pod(container))


def test_a_ucx_sidecar_gets_cross_node_ucx_settings_and_sidecar_env_overrides_them() -> None:
    ucx = env_of(inject_into(hash_seed_pool(), pod(vllm()))["spec"]["initContainers"][1])
    assert (ucx["UCX_TLS"], ucx["UCX_TCP_TX_SEG_SIZE"], ucx["UCX_TCP_RX_SEG_SIZE"]) == ("tcp,sm,self", "1m", "1m")
    tcp = env_of(inject_into(hash_seed_pool(transport="tcp"), pod(vllm()))["spec"]["initContainers"][1])
    assert not {k for k in tcp if k.startswith("UCX_")}

    own = [{"name": "UCX_TLS", "value": "rc,sm,self"}, {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    out = inject_into(hash_seed_pool(env=own), pod(vllm()))
    env = env_of(out["spec"]["initContainers"][1])
    assert env["UCX_TLS"] == "rc,sm,self" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["UCX_TCP_TX_SEG_SIZE"] == "1m" and env["NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "UCX_TLS" not in env_of(out["spec"]["containers"][0])  # only the sidecar speaks UCX
    kubernetes_validate.validate(out, K8S, strict=True)


@pytest.mark.parametrize("dp_indices", [(0,), (2, 3), (5,), (4, 5, 6, 7)])
def test_the_first_control_port_is_kvo_metrics_whatever_the_dp_start_rank(dp_indices: tuple[int, ...]) -> None:
    container = pods.sidecar_container(pool_name="llama", namespace="ns1", sidecar=sidecar_spec(),
                                    dp_indices=dp_indices, shm_volume=pods.SHM_VOLUME)
    ports = [(p["name"], p["containerPort"]) for p in container["ports"]]
    assert ports == [("kvo-metrics", 5710 + dp_indices[0])] + \
        [(f"kvo-ctrl-{i}", 5710 + i) for i in dp_indices[1:]] + [("kvo-data", 5810)]
    assert container["livenessProbe"]["httpGet"]["port"] == 5710 + dp_indices[0]


@pytest.mark.timeout(240)
def test_real_ucx_sidecars_run_with_the_injected_env_and_share_chunks() -> None:
    """The env sidecar_env builds (UCX_TLS=tcp,sm,self, the pool's PYTHONHASHSEED) in real processes."""
    spec = pool_spec.SidecarSpec.from_pool(hash_seed_pool("4321"), default_image="img:1")
    injected = injected_env(spec)
    assert injected["UCX_TLS"] == "tcp,sm,self" and injected["PYTHONHASHSEED"] == "4321"
    assert_ucx_sidecars_share_chunks(injected)


def test_the_sidecar_reads_key_previous_key_and_admin_token_from_the_whole_pool_secret() -> None:
    out = inject(pod(vllm()))
    sidecar = out["spec"]["initContainers"][1]
    argv = sidecar["args"]
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert (flags["--pool-key-file"], flags["--previous-pool-key-file"], flags["--admin-token-file"]) == (
        "/etc/kv-offload-pool-key/key", "/etc/kv-offload-pool-key/previous-key",
        "/etc/kv-offload-pool-key/admin-token")
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    # The whole Secret, no items and no subPath: the kubelet updates every file in place, and
    # previous-key is a file only while the Secret holds it (an absent entry breaks nothing).
    assert volumes["kv-offload-pool-key"] == {"name": "kv-offload-pool-key",
                                              "secret": {"secretName": "llama-pool-key", "optional": True}}
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "kv-offload-pool-key")
    assert mount == {"name": "kv-offload-pool-key", "mountPath": "/etc/kv-offload-pool-key", "readOnly": True}
    assert all("subPath" not in m for c in out["spec"]["initContainers"] + out["spec"]["containers"]
               for m in c.get("volumeMounts") or [])
    # Only the sidecar sees the keys; vLLM gets nothing but the hash seed from the Secret.
    assert "kv-offload-pool-key" not in {m["name"] for m in out["spec"]["containers"][0]["volumeMounts"]}
    assert "--tls-cert-file" not in argv and "kv-offload-tls" not in volumes
    kubernetes_validate.validate(out, K8S, strict=True)


def test_a_tls_pool_mounts_its_certificate_secret_read_only_and_passes_the_tls_flags() -> None:
    out = inject(pod(vllm()), transport="tcp", tls={"secretName": "llama-tls"})
    sidecar = out["spec"]["initContainers"][1]
    argv = sidecar["args"]
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert (flags["--tls-cert-file"], flags["--tls-key-file"], flags["--tls-ca-file"]) == (
        "/etc/kv-offload-tls/tls.crt", "/etc/kv-offload-tls/tls.key", "/etc/kv-offload-tls/ca.crt")
    assert flags["--transport"] == "tcp"
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    assert volumes["kv-offload-tls"]["secret"] == {"secretName": "llama-tls", "optional": True}
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["kv-offload-tls"] == {"name": "kv-offload-tls", "mountPath": "/etc/kv-offload-tls",
                                        "readOnly": True}
    kubernetes_validate.validate(out, K8S, strict=True)


def test_the_injected_sidecar_flags_parse_with_the_sidecars_own_cli() -> None:
    import argparse

    from kv_offload_sidecar.commands import sidecar as sidecar_main

    out = inject(pod(vllm()), transport="tcp", tls={"secretName": "llama-tls"})
    parser = argparse.ArgumentParser(exit_on_error=False)
    sidecar_main.add_arguments(parser)
    args = parser.parse_args(out["spec"]["initContainers"][1]["args"][1:])
    assert args.previous_pool_key_file == pods.PREVIOUS_KEY_PATH
    assert args.admin_token_file == pods.ADMIN_TOKEN_PATH
    assert args.tls_ca_file == "/etc/kv-offload-tls/ca.crt"


def _sidecar_flags(out: dict[str, Any]) -> dict[str, str]:
    sidecar = next(c for c in out["spec"]["initContainers"] if c["name"] == pool_pod.SIDECAR_NAME)
    argv = sidecar["args"]
    return dict(zip(argv[1::2], argv[2::2]))


def test_the_sidecar_is_always_given_its_prefill_rate_and_peer_copies_policy() -> None:
    defaults = _sidecar_flags(inject(pod(vllm())))
    assert (defaults["--prefill-tokens-per-second"], defaults["--peer-copies"]) == ("0", "drop")
    own = _sidecar_flags(inject(pod(vllm()), prefillTokensPerSecond=12500.5, peerCopies="cold"))
    assert (own["--prefill-tokens-per-second"], own["--peer-copies"]) == ("12500.5", "cold")
    whole = _sidecar_flags(inject(pod(vllm()), prefillTokensPerSecond=8000))
    assert whole["--prefill-tokens-per-second"] == "8000"


@pytest.mark.parametrize("rate, text", [(0.0, "0"), (12500.0, "12500"), (2500.25, "2500.25"), (1e-06, "1e-06"),
                                        (1e16, "1e+16")])
def test_a_rate_is_passed_exactly_as_the_shortest_float_text(rate: float, text: str) -> None:
    assert pods.format_rate(rate) == text and float(text) == rate


def test_the_policy_flags_and_nixl_parse_with_the_sidecars_own_cli() -> None:
    import argparse

    from kv_offload_sidecar.commands import sidecar as sidecar_main

    parser = argparse.ArgumentParser(exit_on_error=False)
    sidecar_main.add_arguments(parser)
    out = inject(pod(vllm()), transport="nixl", prefillTokensPerSecond=2500.25, peerCopies="cold",
                 engineMetricsURL="http://127.0.0.1:8000/metrics")
    sidecar = out["spec"]["initContainers"][1]
    args = parser.parse_args(sidecar["args"][1:])
    assert (args.transport, args.prefill_tokens_per_second, args.peer_copies) == ("nixl", 2500.25, "cold")
    assert args.engine_metrics_url == "http://127.0.0.1:8000/metrics"
    # The ucxTransports presets are the ucx transport's: nixl gets no UCX_TLS unless spec.sidecar.env sets one.
    assert "UCX_TLS" not in env_of(sidecar)
    kubernetes_validate.validate(out, K8S, strict=True)
