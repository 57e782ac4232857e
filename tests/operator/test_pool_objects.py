"""The objects the operator writes for a pool (pool_objects.py), without a cluster."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
from kv_offload_operator.pools import pool_objects
from kv_offload_operator.translation.translate import pool_config
from kv_offload_sidecar.engine.contract.model_identity import parse_declared
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from operator_harness import KTC, LLAMA_ARGS, llama_config
from pool_support import K8S, pool, sidecar_spec


@pytest.fixture(scope="module")
def config() -> OffloadingConfig:
    return pool_config(LLAMA_ARGS, llama_config())


def test_configmap_holds_the_config_json_that_loads_back_equal_and_is_owned_by_the_pool(
        config: OffloadingConfig) -> None:
    cm = pool_objects.configmap_for(pool(), config, {"revision": "abc123"})
    assert cm["metadata"]["name"] == "llama-offloading-config"
    assert OffloadingConfig.from_json(cm["data"]["offloading_config.json"]) == config
    document = json.loads(cm["data"]["offloading_config.json"])
    assert parse_declared(document["model_identity"]) == {"revision": "abc123"}
    assert document["fingerprint"] == config.fingerprint
    assert cm["metadata"]["ownerReferences"] == [{
        "apiVersion": "kv-offload.io/v1alpha1", "kind": "KVOffloadPool", "name": "llama",
        "uid": "uid-llama", "controller": True, "blockOwnerDeletion": True}]
    kubernetes_validate.validate(cm, K8S, strict=True)


def test_pool_key_secret_carries_the_given_key_and_refuses_short_keys() -> None:
    secret = pool_objects.pool_key_secret(pool(), b"k" * 32)
    assert secret["metadata"]["name"] == "llama-pool-key"
    assert base64.b64decode(secret["data"]["key"]) == b"k" * 32
    kubernetes_validate.validate(secret, K8S, strict=True)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        pool_objects.pool_key_secret(pool(), b"short")


def test_pool_key_secret_holds_a_secret_hash_seed_and_an_admin_token_but_no_previous_key() -> None:
    data = {k: base64.b64decode(v).decode("latin-1") for k, v in
            pool_objects.pool_key_secret(pool(), b"k" * 32)["data"].items()}
    assert set(data) == {"key", "hash-seed", "admin-token"}
    assert data["hash-seed"].isdigit() and 1 <= int(data["hash-seed"]) <= 4294967295
    assert len(bytes.fromhex(data["admin-token"])) == 32
    again = pool_objects.pool_key_secret(pool(), b"k" * 32)["data"]
    assert base64.b64decode(again["admin-token"]).decode() != data["admin-token"]  # random per Secret


def test_new_hash_seeds_are_decimals_python_accepts_as_pythonhashseed() -> None:
    import subprocess
    import sys

    seeds = {pool_objects.new_hash_seed() for _ in range(2000)}
    assert len(seeds) > 1990
    assert all(s.isdigit() and not s.startswith("0") and 1 <= int(s) <= 4294967295 for s in seeds)
    seed = max(seeds)
    done = subprocess.run([sys.executable, "-c", "import sys; print(sys.flags.hash_randomization)"],
                          env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, timeout=30, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "1"), done.stderr


def test_a_secret_from_the_older_operator_gets_only_the_entries_it_lacks() -> None:
    old = {"key": base64.b64encode(b"k" * 32).decode()}
    missing = pool_objects.missing_secret_data(old)
    assert set(missing) == {"hash-seed", "admin-token"}
    complete = {**old, **missing}
    assert pool_objects.missing_secret_data(complete) == {}
    assert pool_objects.missing_secret_data({**complete, "previous-key": old["key"]}) == {}
    assert set(pool_objects.missing_secret_data({"hash-seed": missing["hash-seed"]})) == {"admin-token"}


def test_peers_service_is_headless_and_lists_one_control_port_per_dp_rank_plus_data() -> None:
    dp4 = pool_config(["vllm", "serve", "m", "-dp", "4", "--kv-transfer-config", KTC], llama_config())
    ports = pool_objects.pool_ports(dp4, sidecar_spec(basePort=6000))
    assert ports == {"kvo-ctrl-0": 6000, "kvo-ctrl-1": 6001, "kvo-ctrl-2": 6002, "kvo-ctrl-3": 6003,
                     "kvo-data": 5810}
    svc = pool_objects.peers_service(pool(), ports)
    assert svc["metadata"]["name"] == "llama-peers"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"kv-offload.io/pool": "llama"}
    kubernetes_validate.validate(svc, K8S, strict=True)


def test_conditions_keep_their_transition_time_until_the_status_flips() -> None:
    first = pool_objects.pool_conditions(None, invalid_message=None, generation=1, now="t1")
    assert {c["type"]: c["status"] for c in first} == {"Ready": "True", "Invalid": "False"}
    same = pool_objects.pool_conditions(first, invalid_message=None, generation=2, now="t2")
    assert [c["lastTransitionTime"] for c in same] == ["t1", "t1"]
    flipped = pool_objects.pool_conditions(same, invalid_message="fix --block-size", generation=3, now="t3")
    invalid = next(c for c in flipped if c["type"] == "Invalid")
    assert (invalid["status"], invalid["message"], invalid["lastTransitionTime"]) == ("True", "fix --block-size", "t3")
    assert pool_objects.invalid_message({"status": {"conditions": flipped}}) == "fix --block-size"
    assert pool_objects.invalid_message({"status": {"conditions": first}}) is None
