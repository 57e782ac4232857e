"""Two `kv-offload operator` replicas (kopf peering) against one emulated cluster.

Both serve real HTTPS AdmissionReviews; only the oldest reconciles. One
replica is killed (SIGKILL, as a node loss) while pods keep being admitted
through the other, which then takes over the reconciler. Which replica wrote
what is told by its credentials: each has its own bearer token.
"""

from __future__ import annotations

import asyncio
import datetime
import signal
from pathlib import Path
from typing import Any

import kmock
import pytest
from kv_offload_operator.rbac import operator_rbac
from metrics_support import value, wait_for_metrics
from operator_harness import NAMESPACE, PEERINGS, POOLS, POOLS_URL, create, emulate_cluster, obj, pool_body
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
    await wait_for_metrics(operator.metrics_port, lambda s: s.get(("kv_offload_operator_leader", frozenset())) == wanted,
                           timeout, operator.log)


def status_of(k: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    return (obj(k, POOLS, name) or {}).get("status") or {}


async def test_two_replicas_both_admit_pods_only_the_oldest_reconciles_and_the_survivor_takes_over(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    certs = tmp_path / "certs"
    ca = make_tls(certs)
    replicas = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        replicas[name] = OperatorProcess(
            tmp_path / name, str(kmock.url), token=f"replica-{name}", env={"POD_ID": f"kv-offload-{name}"},
            extra_args=["--peering", PEERING, "--peering-lifetime-seconds", str(LIFETIME),
                        "--webhook-cert-dir", str(certs), "--ready-peers-check-seconds", "0.3"])
    a, b = replicas["a"], replicas["b"]
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
        fingerprint = await wait_for_async("the pool's fingerprint", lambda: status_of(kmock, "llama").get("fingerprint"))
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


def test_kopfs_rule_is_read_back_the_highest_live_priority_leads_a_tie_or_nobody_alive_leads_none():
    from kv_offload_operator.leadership import leader_of, start_priority

    now = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.timezone.utc)

    def seen(seconds_ago: float, priority: int, lifetime: int = 30) -> dict[str, Any]:
        return {"priority": priority, "lifetime": lifetime,
                "lastseen": (now - datetime.timedelta(seconds=seconds_ago)).isoformat()}

    older, younger = start_priority(1000.0, 5), start_priority(1000.5, 0)
    assert older > younger and abs(older) < 2 ** 53
    assert start_priority(1000.0, 1) != start_priority(1000.0, 2)  # same millisecond, still no tie
    assert leader_of({"a": seen(1, older), "b": seen(1, younger)}, now) == "a"
    assert leader_of({"a": seen(31, older), "b": seen(1, younger)}, now) == "b"  # a's record expired
    assert leader_of({"a": seen(1, 7), "b": seen(1, 7)}, now) is None  # kopf pauses both
    assert leader_of({"a": seen(40, older)}, now) is None
    assert leader_of({"a": None, "b": {"priority": "x"}, "c": seen(1, younger)}, now) == "c"  # cleaned or odd records
    assert leader_of(None, now) is None


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
