"""``status.readyPeers``: the pool's sidecars that report a connected peer, asked of the sidecars themselves.

A sidecar counts when it says so: its ``/metrics`` (the open endpoint on the
pod's ``kvo-metrics`` port, the one the chart's PodMonitor scrapes) shows
``kv_offload_peers{state="connected"} >= 1`` (at least one peer session whose
handshake was accepted, hence same fingerprint, pool key and hash seed, is
up) and ``kv_offload_config_info{fingerprint}`` is the pool's *current*
fingerprint (a sidecar that shows no config_info is taken to run the
fingerprint its pod was injected with). So a sidecar whose handshakes are all
rejected, one still connecting or backing off, a lone sidecar (a pool of one
pod), one left on an older fingerprint after a spec change (it still talks to
its own generation, not to the pool's new pods), a foreign sidecar answering
at a reused pod IP, and one that does not answer within
``SCRAPE_TIMEOUT_SECONDS`` (a NetworkPolicy that keeps the operator out
included) do not count. vLLM's readiness (the pod's Ready condition) does not
matter here.

Which pods are asked: kopf's index ``pool_sidecars`` of the pool's pods whose
``kv-offload-sidecar`` container is started and running (``sidecar_is_running``),
with their pod IP, ``kvo-metrics`` port and injected fingerprint
(``SidecarEndpoint``).

``follow`` (a task started at startup, like the model-config follower) runs on
the leader only (``memo.leading``): every ``--ready-peers-check-seconds`` it
asks every such sidecar (``SCRAPE_CONCURRENCY`` at a time, one short-lived
aiohttp session per round, no credentials) and patches the pool's
``status.readyPeers``, ``status.peerStates`` (peer sessions by state, summed
over the pool's sidecars that run its current fingerprint: ``sum by (state)
(kv_offload_peers)`` of them) and ``status.unansweredSidecars`` (the running
pool sidecars that did not answer) when they differ from what the pool shows
(kopf's pool index ``pool_peer_status``). A new pool shows 0 from its first
reconciliation on (``reconcile``).

``status.modelIdentities``: the model identities (config_info's ``model_identity``
label, 16 hex of what each engine loaded) of the pool's answering sidecars that run its
current fingerprint, as ``[{"identity", "pods"}]``, most pods first. A sidecar whose
engine has not attached yet shows ``""`` and is counted under identity ``""``; one whose
config_info has no such label (a sidecar older than model identities) is not counted.
Two identities are a rolling update to other weights (old and new pods each share with
their own kind, never across); the operator's
``kv_offload_operator_pools_with_mixed_model_identities`` counts the pools showing more
than one non-empty identity.

``status.sidecarVersions``: the releases the same sidecars run (``kv_offload_build_info``'s
``version`` and ``wire`` labels), as ``[{"version", "wire", "pods"}]``, most pods first. A
sidecar that shows no build_info (a release before wire 2.2, such as the last one, wire 2.1)
is counted under version and wire ``""``. Two entries are an upgrade in progress: releases of
the wire window share chunks (``kv_offload_sidecar.peers.wire_window``); a release outside
it is refused ``wire_version_mismatch``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from kv_offload_sidecar.metrics import NAMESPACE as SIDECAR_METRICS_NAMESPACE
from kv_offload_sidecar.metrics import PEER_STATES
from prometheus_client.parser import text_string_to_metric_families

from .pool_api import patch_pool_status
from .pool_pod import INJECTED_ANNOTATION, METRICS_PORT_NAME, SIDECAR_NAME

log = logging.getLogger(__name__)

# The sidecar's gauge of peer sessions by state (connecting|connected|backoff|rejected).
PEERS_METRIC = f"{SIDECAR_METRICS_NAMESPACE}_peers"
# The sidecar's identity series (its labels: fingerprint, transport, model_identity).
CONFIG_INFO_METRIC = f"{SIDECAR_METRICS_NAMESPACE}_config_info"
# The sidecar's release series (its labels: version, wire); absent before wire 2.2.
BUILD_INFO_METRIC = f"{SIDECAR_METRICS_NAMESPACE}_build_info"
# Seconds one sidecar has to answer /metrics (connect and body).
SCRAPE_TIMEOUT_SECONDS = 2.0
# Sidecars asked at once, over all pools.
SCRAPE_CONCURRENCY = 32
# A /metrics body larger than this is not read (a sidecar's is a few tens of KiB).
MAX_METRICS_BYTES = 4 << 20


@dataclass(frozen=True)
class SidecarEndpoint:
    """One running pool sidecar, as kopf's pod index keeps it."""

    pod: str
    # The fingerprint the webhook injected it with (annotation kv-offload.io/injected).
    fingerprint: str
    # status.podIP; None before the pod has one.
    ip: str | None
    # containerPort of its kvo-metrics port; None when it declares none.
    port: int | None

    @property
    def metrics_url(self) -> str | None:
        """``http://<podIP>:<kvo-metrics>/metrics``, or None when either is unknown."""
        if not self.ip or not self.port:
            return None
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}/metrics"


@dataclass(frozen=True)
class SidecarAnswer:
    """What one sidecar's /metrics says."""

    # kv_offload_peers by state (0 for a state it does not show).
    states: Mapping[str, int]
    # kv_offload_config_info's fingerprint label; None when it shows none.
    fingerprint: str | None = None
    # kv_offload_config_info's model_identity label: 16 hex, "" before its engine attached,
    # None when the series has no such label (a sidecar older than model identities).
    model_identity: str | None = None
    # kv_offload_build_info's (version, wire), e.g. ("0.1.0", "2.2"); None when it shows none
    # (a release before wire 2.2).
    release: tuple[str, str] | None = None


@dataclass(frozen=True)
class PoolPeerStatus:
    """What a pool's status shows (kopf's pool index): compared before writing."""

    fingerprint: str | None
    ready_peers: int | None
    peer_states: Mapping[str, int] | None
    unanswered: int | None
    # status.modelIdentities as (identity, pods) pairs; None when the status has none.
    model_identities: tuple[tuple[str, int], ...] | None = None
    # status.sidecarVersions as (version, wire, pods); None when the status has none.
    sidecar_versions: tuple[tuple[str, str, int], ...] | None = None


@dataclass(frozen=True)
class PeerCount:
    """One pool's answer: what goes to its status."""

    ready_peers: int
    peer_states: dict[str, int]
    unanswered: int
    # (model identity, pods showing it), most pods first, then by identity.
    model_identities: tuple[tuple[str, int], ...] = ()
    # (release version, wire version, pods running it), most pods first; "" for a release
    # that shows no build_info.
    sidecar_versions: tuple[tuple[str, str, int], ...] = ()

    def status(self) -> dict[str, Any]:
        return {"readyPeers": self.ready_peers, "peerStates": dict(self.peer_states),
                "unansweredSidecars": self.unanswered,
                "modelIdentities": [{"identity": i, "pods": n} for i, n in self.model_identities],
                "sidecarVersions": [{"version": v, "wire": w, "pods": n} for v, w, n in self.sidecar_versions]}

    @property
    def mixed_model_identities(self) -> bool:
        """More than one identity among the sidecars whose engine has attached."""
        return sum(1 for identity, _ in self.model_identities if identity) > 1

    def shown_in(self, shown: PoolPeerStatus | None) -> bool:
        return shown is not None and (shown.ready_peers, dict(shown.peer_states or {}), shown.unanswered,
                                      shown.model_identities, shown.sidecar_versions) == \
            (self.ready_peers, self.peer_states, self.unanswered, self.model_identities,
             self.sidecar_versions)


def sidecar_is_running(status: Mapping[str, Any] | None, annotations: Mapping[str, str] | None,
                       **_: Any) -> bool:
    """The pod's injected sidecar is started and running (a kopf ``when`` filter)."""
    if not (annotations or {}).get(INJECTED_ANNOTATION):
        return False
    for c in (status or {}).get("initContainerStatuses") or []:
        if c.get("name") == SIDECAR_NAME:
            return bool(c.get("started")) and "running" in (c.get("state") or {})
    return False


def metrics_port(spec: Mapping[str, Any] | None) -> int | None:
    """containerPort of the sidecar container's ``kvo-metrics`` port (native sidecar or plain container)."""
    spec = spec or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if c.get("name") != SIDECAR_NAME:
            continue
        for p in c.get("ports") or []:
            if p.get("name") == METRICS_PORT_NAME and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


def sidecar_endpoint(name: str, annotations: Mapping[str, str], spec: Mapping[str, Any] | None,
                     status: Mapping[str, Any] | None) -> SidecarEndpoint:
    """The index value of a pool pod whose sidecar runs."""
    return SidecarEndpoint(pod=name, fingerprint=annotations[INJECTED_ANNOTATION],
                           ip=(status or {}).get("podIP") or None, port=metrics_port(spec))


def pool_peer_status(status: Mapping[str, Any] | None) -> PoolPeerStatus:
    """The index value of a pool."""
    status = status or {}
    states = status.get("peerStates")
    identities = status.get("modelIdentities")
    versions = status.get("sidecarVersions")
    return PoolPeerStatus(fingerprint=status.get("fingerprint"), ready_peers=status.get("readyPeers"),
                          peer_states=dict(states) if isinstance(states, Mapping) else None,
                          unanswered=status.get("unansweredSidecars"),
                          model_identities=tuple((str(e.get("identity", "")), e.get("pods"))
                                                 for e in identities if isinstance(e, Mapping))
                          if isinstance(identities, list) else None,
                          sidecar_versions=tuple((str(e.get("version", "")), str(e.get("wire", "")), e.get("pods"))
                                                 for e in versions if isinstance(e, Mapping))
                          if isinstance(versions, list) else None)


def read_metrics(text: str) -> SidecarAnswer:
    """``kv_offload_peers`` by state and the config_info fingerprint and model identity from a
    sidecar's /metrics text.

    Only those two families' lines go to prometheus_client's parser (a sidecar's whole
    exposition is mostly histograms the operator does not need); ValueError when they
    do not parse.
    """
    wanted = tuple(f"{prefix}{name}{end}" for name in (PEERS_METRIC, CONFIG_INFO_METRIC, BUILD_INFO_METRIC)
                   for prefix, end in (("", "{"), ("", " "), ("# HELP ", " "), ("# TYPE ", " ")))
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    states = dict.fromkeys(PEER_STATES, 0)
    fingerprint = model_identity = release = None
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == PEERS_METRIC:
                state = sample.labels.get("state")
                if state in states and sample.value == sample.value:  # not NaN
                    states[state] = int(sample.value)
            elif sample.name == CONFIG_INFO_METRIC and sample.value == 1:
                fingerprint = sample.labels.get("fingerprint") or None
                model_identity = sample.labels.get("model_identity")
            elif sample.name == BUILD_INFO_METRIC and sample.value == 1 and sample.labels.get("wire"):
                release = (sample.labels.get("version", ""), sample.labels.get("wire", ""))
    return SidecarAnswer(states, fingerprint, model_identity, release)


async def ask(session: aiohttp.ClientSession, url: str, timeout: float) -> SidecarAnswer | None:
    """What the sidecar at ``url`` says, or None when it does not answer (in time, with 200, parseably)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False) as resp:
            if resp.status != 200:
                return None
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return None
        return read_metrics(body.decode("utf-8", errors="replace"))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


def count(answers: Iterable[tuple[SidecarEndpoint, SidecarAnswer | None]], fingerprint: str) -> PeerCount:
    """A pool's count from its running sidecars' answers (None: did not answer).

    Only sidecars that run ``fingerprint`` (their config_info's, else their pod's) count, add
    their sessions to the states, their model identity to the identities and their release to
    the versions; every one that did not answer is unanswered."""
    ready, unanswered = 0, 0
    states = dict.fromkeys(PEER_STATES, 0)
    identities: dict[str, int] = {}
    releases: dict[tuple[str, str], int] = {}
    for endpoint, answer in answers:
        if answer is None:
            unanswered += 1
            continue
        if (answer.fingerprint or endpoint.fingerprint) != fingerprint:
            continue  # an older generation, or another pool's sidecar at a reused IP
        if answer.states.get("connected", 0) >= 1:
            ready += 1
        for state in states:
            states[state] += int(answer.states.get(state, 0))
        if answer.model_identity is not None:
            identities[answer.model_identity] = identities.get(answer.model_identity, 0) + 1
        release = answer.release or ("", "")
        releases[release] = releases.get(release, 0) + 1
    ranked = tuple(sorted(identities.items(), key=lambda item: (-item[1], item[0])))
    versions = tuple((v, w, n) for (v, w), n in sorted(releases.items(), key=lambda item: (-item[1], item[0])))
    return PeerCount(ready, states, unanswered, ranked, versions)


async def check(memo: kopf.Memo, sidecars: kopf.Index, pools: kopf.Index, timeout: float,
                written: dict[tuple[str, str], tuple[PoolPeerStatus, PeerCount]]) -> None:
    """Ask every running sidecar of every translated pool once; write the pools whose count changed.

    ``written``: per pool, what its index showed when this replica last wrote it and what it
    wrote; the same count is not written again before the index has seen the write."""
    # Snapshots: the indexes change under kopf's watches while this awaits.
    shown: dict[tuple[str, str], PoolPeerStatus] = {}
    for key in list(pools):
        value = next(iter(pools.get(key, [])), None)
        if value is not None and value.fingerprint:
            shown[key] = value
    asked = {key: list(sidecars.get(key, [])) for key in shown}
    for gone in set(written) - set(shown):
        del written[gone]
    if not shown:
        memo.metrics.pools_with_mixed_model_identities.set(0)
        return
    limit = asyncio.Semaphore(SCRAPE_CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=SCRAPE_CONCURRENCY, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def ask_one(endpoint: SidecarEndpoint) -> tuple[SidecarEndpoint, SidecarAnswer | None]:
            url = endpoint.metrics_url
            if url is None:
                return endpoint, None
            async with limit:
                return endpoint, await ask(session, url, timeout)

        pending = {key: asyncio.gather(*(ask_one(s) for s in endpoints)) for key, endpoints in asked.items()}
        answers = {key: await gathering for key, gathering in pending.items()}
    counts = {key: count(answered, shown[key].fingerprint or "") for key, answered in answers.items()}
    memo.metrics.pools_with_mixed_model_identities.set(
        sum(1 for new in counts.values() if new.mixed_model_identities))
    for key, answered in answers.items():
        new = counts[key]
        if new.shown_in(shown[key]) or written.get(key) == (shown[key], new):
            continue
        namespace, name = key
        try:
            await patch_pool_status(memo.api, namespace, name, new.status())
        except asyncio.CancelledError:
            raise
        except ApiException as exc:
            if exc.status != 404:  # 404: the pool is gone
                log.warning(f"Pool {namespace}/{name}: writing status.readyPeers failed (HTTP {exc.status}); "
                            f"retrying at the next check.")
            continue
        except Exception as exc:  # the API unreachable: the next check tries again
            log.warning(f"Pool {namespace}/{name}: writing status.readyPeers failed ({exc}); "
                        f"retrying at the next check.")
            continue
        written[key] = (shown[key], new)
        if new.ready_peers != shown[key].ready_peers:
            log.info(f"Pool {namespace}/{name}: {new.ready_peers} ready peers "
                     f"({len(answered)} running sidecars asked, {new.unanswered} did not answer).")


async def follow(memo: kopf.Memo, sidecars: kopf.Index, pools: kopf.Index) -> None:
    """Check every ``ready_peers_check_seconds`` (after the previous round) while this replica
    leads, until cancelled."""
    interval = memo.options.ready_peers_check_seconds
    written: dict[tuple[str, str], tuple[PoolPeerStatus, PeerCount]] = {}
    while True:
        await asyncio.sleep(interval)
        if not memo.leading:  # another replica reconciles (leadership.py)
            continue
        try:
            await check(memo, sidecars, pools, SCRAPE_TIMEOUT_SECONDS, written)
        except asyncio.CancelledError:
            raise
        except Exception:  # the next round tries again
            log.exception("Counting the pools' ready peers failed")
