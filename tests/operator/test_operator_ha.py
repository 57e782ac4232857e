"""Two `kv-offload operator` replicas (kopf peering) against one emulated cluster.

Both serve real HTTPS AdmissionReviews; only the oldest reconciles. One
replica is killed (SIGKILL, as a node loss) while pods keep being admitted
through the other, which then takes over the reconciler. Which replica wrote
what is told by its credentials: each has its own bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import signal
from pathlib import Path
from typing import Any

import kmock
import pytest
from kv_offload_testing.frozen import freeze
from kv_offload_operator.rbac import operator_rbac
from metrics_support import value, wait_for_metrics
from operator_harness import LLAMA_ARGS, NAMESPACE, PEERINGS, POOLS, POOLS_URL, create, emulate_cluster
from operator_harness import llama_config, merge_patch, obj, pool_body
from operator_process import OperatorProcess, make_tls
from waiting import wait_for_async
from webhook_support import Webhook, vllm_pod

pytestmark = pytest.mark.timeout(150)

PEERING = "kv-offload"
LIFETIME = 5  # seconds before a killed replica's peering record expires
WRITES = {"POST", "PATCH", "PUT", "DELETE"}
POOL_CHILDREN = {"kvoffloadpools", "configmaps", "secrets", "services"}


def writes_by(k: kmock.KubernetesEmulator, since: int = 0) -> dict[str, list[str]]:
    """{bearer token: ["METHOD plural[/sub] name", ...]} of the writes to pools and their children."""
    found: dict[str, list[str]] = {}
    for req in list(k)[since:]:
        if req.resource is None or str(req.method.value).upper() not in WRITES:
            continue
        if req.resource.plural not in POOL_CHILDREN:
            continue
        token = req.headers.get("Authorization", "").removeprefix("Bearer ")
        if not token.startswith("replica-"):
            continue  # the test's own requests
        what = f"{req.method.value} {req.resource.plural}{'/' + req.subresource if req.subresource else ''}"
        found.setdefault(token, []).append(what)
    return found


def requests_by(k: kmock.KubernetesEmulator, token: str) -> set[tuple[str, str, str]]:
    """(group, plural[/subresource], verb) of every request a replica made (for its RBAC)."""
    verbs = {"list": "list", "watch": "watch", "fetch": "get", "create": "create", "delete": "delete"}
    used = set()
    for req in list(k):
        if req.resource is None or not req.resource.plural:
            continue
        if req.headers.get("Authorization", "") != f"Bearer {token}":
            continue
        action = str(req.action.value).lower() if req.action is not None else ""
        verb = {"PATCH": "patch", "PUT": "update"}.get(str(req.method.value).upper()) or verbs.get(action, action)
        used.add((req.resource.group or "", req.resource.plural + (f"/{req.subresource}" if req.subresource else ""),
                  verb))
    return used


async def wait_leader_gauge(operator: OperatorProcess, wanted: float, timeout: float = 60) -> None:
    leader = ("kv_offload_operator_leader", frozenset())
    await wait_for_metrics(operator.metrics_port, lambda s: s.get(leader) == wanted, timeout, operator.log)


def status_of(k: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    return (obj(k, POOLS, name) or {}).get("status") or {}


def two_replicas(k: kmock.KubernetesEmulator, tmp_path: Path, *extra_args: str) -> tuple[OperatorProcess, ...]:
    """Replicas a and b (not started) with kopf peering, each with its own bearer token."""
    replicas = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        replicas.append(OperatorProcess(
            tmp_path / name, str(k.url), token=f"replica-{name}", env={"POD_ID": f"kv-offload-{name}"},
            extra_args=["--peering", PEERING, "--peering-lifetime-seconds", str(LIFETIME), *extra_args]))
    return tuple(replicas)


async def test_two_replicas_both_admit_pods_only_the_oldest_reconciles_and_the_survivor_takes_over(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    certs = tmp_path / "certs"
    ca = make_tls(certs)
    a, b = two_replicas(kmock, tmp_path, "--webhook-cert-dir", str(certs), "--ready-peers-check-seconds", "0.3")
    await a.start()
    try:
        await wait_leader_gauge(a, 1)
        await b.start()
        # The operator made its peering object; both replicas keep their records in it.
        await wait_for_async("both replicas' peering records", lambda: {"kv-offload-a", "kv-offload-b"} <= set(
            (obj(kmock, PEERINGS, PEERING, NAMESPACE) or {}).get("status") or {}))
        await wait_leader_gauge(b, 0)
        # kopf starts b's watches paused and keeps them so while a, the older replica, lives.
        await wait_for_async("b's paused pool watch", lambda: "Pausing the watch-stream for kvoffloadpools" in b.log())

        await create(kmock, POOLS_URL, pool_body("llama"))
        fingerprint = await wait_for_async("the pool's fingerprint",
                                           lambda: status_of(kmock, "llama").get("fingerprint"))
        # The ready-peers follower runs on the leader only (no pods: 0 ready, no sessions).
        await wait_for_async("the leader's ready-peers count", lambda: "peerStates" in status_of(kmock, "llama"))
        for operator in (a, b):
            webhook = Webhook(operator.webhook_port, ca)
            await webhook.wait_listening()
            response = await webhook.admit(vllm_pod())
            assert response["allowed"] is True and response.get("patch"), response
        await asyncio.sleep(1.0)  # anything b would wrongly write on its events has arrived by now
        writers = writes_by(kmock)
        assert set(writers) == {"replica-a"}, writers  # only the leader reconciled
        assert "Resuming operations" not in b.log()
        # Pools are reported by the replica that reconciles, so a sum over replicas counts each once.
        ready = {"condition": "Ready"}
        await wait_for_metrics(a.metrics_port, lambda s: value(s, "kv_offload_operator_pools", **ready) == 1,
                               log=a.log)
        assert value(await wait_for_metrics(b.metrics_port), "kv_offload_operator_pools", **ready) == 0
        assert any(w.startswith("PATCH kvoffloadpools/status") for w in writers["replica-a"])

        # Replica a dies while the API server keeps sending pods to b.
        through_b = Webhook(b.webhook_port, ca)
        answers: list[dict[str, Any]] = []
        stop = asyncio.Event()

        async def admit_through_b() -> None:
            while not stop.is_set():
                answers.append(await through_b.admit(vllm_pod()))
                await asyncio.sleep(0.05)

        admitting = asyncio.create_task(admit_through_b())
        await wait_for_async("admissions through b", lambda: len(answers) >= 3)
        killed_at = len(list(kmock))
        await a.stop(signal.SIGKILL)
        admitted_at_kill = len(answers)
        await wait_leader_gauge(b, 1, timeout=LIFETIME * 6)
        await create(kmock, POOLS_URL, pool_body("second"))
        second = await wait_for_async("the second pool reconciled by b",
                                      lambda: status_of(kmock, "second").get("fingerprint"))
        stop.set()
        await admitting
        assert second == fingerprint  # same vLLM args: same translation
        await wait_for_async("the new leader's ready-peers count", lambda: "peerStates" in status_of(kmock, "second"))
        assert len(answers) > admitted_at_kill + 3  # admissions went on while a was dead
        assert all(answer["allowed"] is True and answer.get("patch") for answer in answers)
        later = writes_by(kmock, since=killed_at)
        assert set(later) == {"replica-b"}, later
        assert any(w.startswith("POST configmaps") for w in later["replica-b"])
        assert obj(kmock, "v1/configmaps", "second-offloading-config") is not None
        assert "now runs the reconciler" in b.log()
        await wait_for_metrics(b.metrics_port, lambda s: value(s, "kv_offload_operator_pools", **ready) == 2,
                               log=b.log)
        # Each replica stayed within the namespaced operator's RBAC (a KopfPeering, no cluster peering).
        granted = {(group, plural, verb) for (group, plural), verbs in operator_rbac(False).items() for verb in verbs}
        for token in ("replica-a", "replica-b"):
            assert requests_by(kmock, token) - granted == set(), token
    finally:
        for operator in (a, b):
            if operator.proc is not None:
                await operator.stop()


def kopf_runs(operator: OperatorProcess) -> bool:
    """What kopf itself last said in the replica's log: it resumed (runs) or paused. kopf starts
    a replica with peering paused and says so only once it resumes."""
    log = operator.log()
    said = max((log.rfind(line), line) for line in (
        "Resuming operations after the pause", "Pausing operations in favour of", "Pausing all operators"))
    return said[0] >= 0 and said[1].startswith("Resuming")


def follower_writers(k: kmock.KubernetesEmulator, since: int, field: str = "modelConfigDigest") -> set[str]:
    """The replicas (bearer tokens) that wrote ``field`` into a pool's status since request
    ``since``: the model-config follower's (kopf's handlers do not run then: no pool changed),
    or with ``peerStates`` the ready-peers follower's."""
    return {r.headers.get("Authorization", "").removeprefix("Bearer ") for r in list(k)[since:]
            if str(r.method.value).upper() == "PATCH" and r.subresource == "status"
            and field in ((r.data or {}).get("status") or {})}


async def test_the_followers_run_where_kopf_lets_its_handlers_run_across_a_leader_change_and_a_paused_leader(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    model_url = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    await create(kmock, model_url, {"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": "llama-model", "namespace": NAMESPACE},
                                    "data": {"config.json": json.dumps(llama_config())}})
    a, b = two_replicas(kmock, tmp_path, "--model-config-check-seconds", "0.3", "--ready-peers-check-seconds", "0.3")

    async def edit_model_and_see_who_follows(layers: int) -> set[str]:
        """Edit the followed ConfigMap (kopf watches no ConfigMap) and wait for the pool's new digest."""
        since, before = len(list(kmock)), status_of(kmock, "llama").get("modelConfigDigest")
        await merge_patch(kmock, f"{model_url}/llama-model",
                          {"data": {"config.json": json.dumps(dict(llama_config(), num_hidden_layers=layers))}})
        await wait_for_async(f"the {layers}-layer model translated",
                             lambda: status_of(kmock, "llama").get("modelConfigDigest") not in (None, before))
        await asyncio.sleep(1.0)  # three follower rounds: a second replica's write would be here by now
        return follower_writers(kmock, since)

    await a.start()
    try:
        await wait_for_async("kopf running a", lambda: kopf_runs(a))
        await b.start()
        await wait_leader_gauge(b, 0)
        await wait_for_async("b's paused pool watch", lambda: "Pausing the watch-stream for kvoffloadpools" in b.log())
        body = pool_body("llama")
        del body["spec"]["modelConfig"]
        body["spec"]["modelConfigRef"] = {"name": "llama-model"}
        await create(kmock, POOLS_URL, body)
        await wait_for_async("the pool translated", lambda: status_of(kmock, "llama").get("fingerprint"))
        assert kopf_runs(a) and not kopf_runs(b)
        assert await edit_model_and_see_who_follows(16) == {"replica-a"}

        # The leader is paused (SIGSTOP: a VM stall, a frozen container): its record expires and
        # kopf resumes b.
        # The ready-peers follower counted the pool on a alone (b's, paused, wrote nothing).
        await wait_for_async("a's ready-peers count", lambda: "peerStates" in status_of(kmock, "llama"))
        assert follower_writers(kmock, 0, "peerStates") == {"replica-a"}
        freeze(a.proc.pid)
        await wait_for_async("kopf resuming b", lambda: kopf_runs(b), timeout=LIFETIME * 6)
        await wait_leader_gauge(b, 1, timeout=LIFETIME * 2)
        assert await edit_model_and_see_who_follows(24) == {"replica-b"}

        # It comes back: kopf lets the older replica run again and pauses b.
        a.proc.send_signal(signal.SIGCONT)
        await wait_for_async("kopf pausing b for a", lambda: not kopf_runs(b), timeout=LIFETIME * 6)
        assert kopf_runs(a)
        await wait_leader_gauge(b, 0, timeout=LIFETIME * 2)
        await wait_leader_gauge(a, 1, timeout=LIFETIME * 2)
        assert await edit_model_and_see_who_follows(20) == {"replica-a"}
        # Kopf's own handlers agree: a spec change is reconciled by a alone.
        since = len(list(kmock))
        await merge_patch(kmock, f"{POOLS_URL}/llama", {"metadata": {"generation": 2},
                                                        "spec": {"vllmArgs": [*LLAMA_ARGS, "--max-model-len", "8192"]}})
        await wait_for_async("the spec change reconciled",
                             lambda: status_of(kmock, "llama").get("observedGeneration") == 2)
        await asyncio.sleep(1.0)
        assert set(writes_by(kmock, since)) == {"replica-a"}
    finally:
        for operator in (a, b):
            if operator.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    operator.proc.send_signal(signal.SIGCONT)
                await operator.stop()


def test_kopfs_rule_is_asked_for_this_replica_a_live_higher_or_equal_peer_pauses_it_its_own_record_never():
    from kv_offload_operator.leadership import paused_by, start_priority

    now = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.timezone.utc)

    def seen(seconds_ago: float, priority: int, lifetime: int = 30) -> dict[str, Any]:
        return {"priority": priority, "lifetime": lifetime,
                "lastseen": (now - datetime.timedelta(seconds=seconds_ago)).isoformat()}

    older, younger = start_priority(1000.0, 5), start_priority(1000.5, 0)
    assert older > younger and abs(older) < 2 ** 53
    assert start_priority(1000.0, 1) != start_priority(1000.0, 2)  # same millisecond, still no tie
    both = {"a": seen(1, older), "b": seen(1, younger)}
    assert paused_by(both, "a", older, now) == [] and paused_by(both, "b", younger, now) == ["a"]
    assert paused_by({"a": seen(31, older), "b": seen(1, younger)}, "b", younger, now) == []  # a's expired
    assert paused_by({"a": seen(1, 7), "b": seen(1, 7)}, "a", 7, now) == ["b"]  # a tie: kopf pauses both
    # A replica back from a pause (SIGSTOP) whose own record expired still runs, as kopf lets it.
    assert paused_by({"a": seen(40, older), "b": seen(1, younger)}, "a", older, now) == []
    assert paused_by({"a": None, "b": {"priority": "x"}, "c": seen(1, younger)}, "d", younger - 1, now) == ["c"]
    assert paused_by(None, "a", older, now) == [] and paused_by({}, "a", older, now) == []



async def test_a_replica_that_may_not_create_its_peering_object_exits_saying_what_to_grant(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    kmock[f"post /apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings"] << 403
    operator = OperatorProcess(tmp_path, str(kmock.url), extra_args=["--peering", PEERING])
    await operator.start()
    assert operator.proc is not None
    assert await asyncio.wait_for(operator.proc.wait(), 60) == 1
    last = operator.log().strip().splitlines()[-1]
    assert last.startswith(f"kv-offload operator: --peering {PEERING}: cannot create the peering object "
                           f"KopfPeering in namespace '{NAMESPACE}' '{PEERING}' (HTTP 403")
    assert last.endswith("grant the operator create on kopfpeerings (the chart's RBAC)")


def test_the_operator_refuses_clashing_ports_and_a_too_short_peering_lifetime_with_one_line() -> None:
    import subprocess

    from operator_harness import KV_OFFLOAD

    for args, said in ((["--health-port", "8081"], "--health-port and --metrics-port must differ (both 8081)"),
                       (["--peering", "kvo", "--peering-lifetime-seconds", "2"],
                        "--peering-lifetime-seconds 2 is too short; use 5 or more")):
        done = subprocess.run([KV_OFFLOAD, "operator", "-n", "ns1", *args], capture_output=True, text=True,
                              timeout=60)
        assert (done.returncode, done.stdout, done.stderr.strip()) == (2, "", f"kv-offload operator: {said}")
