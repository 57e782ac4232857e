"""A pool pinning a sidecar image outside the releases this operator drives is refused with a
condition and an event, never given pods whose sidecar crash-loops; an unversioned tag is unchecked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest
from kv_offload_operator.pools import sidecar_image
from kv_offload_operator.pools.sidecar_image import (
    NEWEST_SIDECAR_VERSION,
    OLDEST_SIDECAR_VERSION,
    check,
    image_conditions,
    image_tag,
)
from operator_harness import POOLS, POOLS_URL, create, emulate_cluster, obj, pool_body
from operator_process import OperatorProcess
from waiting import wait_for_async

NOW = "2026-12-06T10:00:00Z"
RANGE = f"kv-offload {OLDEST_SIDECAR_VERSION} to {NEWEST_SIDECAR_VERSION}"


def pinned(image: str) -> dict[str, Any]:
    return {"sidecar": {"image": image}}


def test_the_tag_is_read_past_a_registry_port_and_before_a_digest() -> None:
    assert image_tag("registry:5000/team/kv-offload:v0.1.0-cuda@sha256:" + "a" * 64) == "v0.1.0-cuda"
    assert image_tag("registry:5000/kv-offload@sha256:" + "a" * 64) is None
    assert image_tag("kv-offload") is None


@pytest.mark.parametrize("image", [f"kv-offload:{OLDEST_SIDECAR_VERSION}",
                                   f"r:5000/kv-offload:v{NEWEST_SIDECAR_VERSION}",
                                   f"kv-offload:{NEWEST_SIDECAR_VERSION}-cuda12"])
def test_a_pinned_release_inside_the_window_is_supported(image: str) -> None:
    result = check(pinned(image))
    assert (result.status, result.reason, result.refused) == ("True", "Supported", False)
    assert image in result.message and RANGE in result.message


@pytest.mark.parametrize("image,version", [("kv-offload:0.0.9", "0.0.9"), ("kv-offload:v99.0.0", "99.0.0")])
def test_a_pinned_release_outside_the_window_is_refused_naming_image_version_and_range(image: str,
                                                                                     version: str) -> None:
    result = check(pinned(image))
    assert (result.status, result.reason, result.refused) == ("False", "Unsupported", True)
    for text in (repr(image), f"kv-offload {version}", RANGE):
        assert text in result.message, text


@pytest.mark.parametrize("image", ["kv-offload:latest", "kv-offload@sha256:" + "b" * 64, "kv-offload"])
def test_a_tag_naming_no_release_is_accepted_and_said_to_be_unchecked(image: str) -> None:
    result = check(pinned(image))
    assert (result.status, result.reason, result.refused) == ("Unknown", "Unchecked", False)
    assert "unchecked" in result.message and RANGE in result.message


def test_no_pin_runs_the_operators_own_image() -> None:
    assert check({}).status == "True" and check({}).reason == "OperatorImage"


def test_the_condition_keeps_its_transition_time_until_its_status_flips() -> None:
    (first,) = image_conditions(None, check(pinned("kv-offload:latest")), 1, NOW)
    (same,) = image_conditions([first], check(pinned("kv-offload:dev")), 2, "later")
    assert same["lastTransitionTime"] == NOW and same["observedGeneration"] == 2
    (flipped,) = image_conditions([same], check(pinned("kv-offload:0.0.1")), 3, "later")
    assert (flipped["status"], flipped["lastTransitionTime"]) == ("False", "later")


def status_of(k: kmock.KubernetesEmulator, name: str) -> dict[str, Any]:
    return (obj(k, POOLS, name) or {}).get("status") or {}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def events_about(k: kmock.KubernetesEmulator, name: str) -> list[dict[str, Any]]:
    return [dict(o.raw) for (res, _, _), o in list(k.objects.items()) if res == kmock.resource("v1/events")
            and not o.deleted and (dict(o.raw).get("involvedObject") or {}).get("name") == name]


@pytest.mark.timeout(240)
async def test_a_pool_pinning_an_older_sidecar_release_is_invalid_with_a_condition_and_an_event(
        kmock: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    emulate_cluster(kmock)
    old = pool_body("old", sidecar={"image": "registry.example/kv-offload:0.0.9"})
    unversioned = pool_body("dev", sidecar={"image": "registry.example/kv-offload:latest"})
    async with OperatorProcess(tmp_path, str(kmock.url)):
        await create(kmock, POOLS_URL, old)
        await create(kmock, POOLS_URL, unversioned)
        invalid = await wait_for_async("the Invalid condition", lambda: condition(
            status_of(kmock, "old"), "Invalid").get("status") == "True"
            and condition(status_of(kmock, "old"), "Invalid"))
        posted = await wait_for_async("the refusal event", lambda: [
            e for e in events_about(kmock, "old") if e.get("reason") == sidecar_image.REFUSED_EVENT])
        unchecked = await wait_for_async("the unchecked pool's status", lambda: status_of(kmock, "dev").get(
            "fingerprint") and condition(status_of(kmock, "dev"), "SidecarImage"))
    for text in ("'registry.example/kv-offload:0.0.9'", "kv-offload 0.0.9", RANGE):
        assert text in invalid["message"], text
    st = status_of(kmock, "old")
    assert condition(st, "SidecarImage")["status"] == "False" and condition(st, "Ready")["status"] == "False"
    assert posted[0]["type"] == "Warning" and posted[0]["message"] == invalid["message"]
    assert obj(kmock, "v1/configmaps", "old-offloading-config") is None  # no pods are admitted to it
    assert obj(kmock, POOLS, "old") is not None
    # an unversioned tag: the pool works, and says its image is unchecked
    assert (unchecked["status"], unchecked["reason"]) == ("Unknown", "Unchecked")
    assert condition(status_of(kmock, "dev"), "Ready")["status"] == "True"
    assert obj(kmock, "v1/configmaps", "dev-offloading-config") is not None
