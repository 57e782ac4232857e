"""A pool's model config.json: inline in ``spec.modelConfig`` or in the ConfigMap ``spec.modelConfigRef`` names.

Read by the reconciler, the model-config follower (which compares the
content digest with ``status.modelConfigDigest``) and the webhook. Problems
with the spec raise ``PoolSpecError``; a ConfigMap that does not exist yet
raises ``kopf.TemporaryError`` (retried).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .pool_spec import PoolSpecError

DEFAULT_KEY = "config.json"


def content_digest(text: str) -> str:
    """Short content digest of a model config as read (``status.modelConfigDigest``)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


async def model_config(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any],
                       patch: kopf.Patch | None = None) -> Mapping[str, Any]:
    """The model's config.json, inline or from the modelConfigRef ConfigMap (whose content
    digest goes to ``patch.status.modelConfigDigest``, valid or not, for the follower)."""
    if "modelConfig" in spec and "modelConfigRef" in spec:
        raise PoolSpecError("set only one of spec.modelConfig or spec.modelConfigRef")
    if "modelConfig" in spec:
        return spec["modelConfig"]
    text = await model_config_text(api, namespace, spec)
    if patch is not None:
        patch.status["modelConfigDigest"] = content_digest(text)
    ref = spec["modelConfigRef"]
    key = ref.get("key") or DEFAULT_KEY
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PoolSpecError(f"ConfigMap {ref['name']!r} key {key!r} is not JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise PoolSpecError(f"ConfigMap {ref['name']!r} key {key!r} must hold a JSON object (config.json)")
    return loaded


async def model_config_text(api: k8s.ApiClient, namespace: str, spec: Mapping[str, Any]) -> str:
    """The text under the modelConfigRef ConfigMap's key; PoolSpecError / TemporaryError
    (the ConfigMap does not exist yet) saying what to change."""
    ref = spec.get("modelConfigRef")
    if not ref or not ref.get("name"):
        raise PoolSpecError("set spec.modelConfig (the model's config.json) or spec.modelConfigRef.name")
    key = ref.get("key") or DEFAULT_KEY
    try:
        cm = await k8s.CoreV1Api(api).read_namespaced_config_map(ref["name"], namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise kopf.TemporaryError(f"ConfigMap {ref['name']!r} named by spec.modelConfigRef does not exist "
                                      f"in namespace {namespace!r}; waiting for it", delay=30) from None
        raise
    text = (cm.data or {}).get(key)
    if text is None:
        raise PoolSpecError(f"ConfigMap {ref['name']!r} has no key {key!r} (spec.modelConfigRef.key)")
    return str(text)
