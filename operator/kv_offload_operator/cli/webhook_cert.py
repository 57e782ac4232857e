"""`kv-offload webhook-cert create|patch`: the webhook certificate Jobs of the chart (no cert-manager).

``create`` (a pre-install/pre-upgrade hook) writes the webhook's TLS Secret
(``ca.crt``, ``tls.crt``, ``tls.key``) when it is missing or cannot serve
(``webhook.certificate.pair_problem``), and otherwise leaves it as it is, so every
upgrade keeps the certificate; the Secret carries ``helm.sh/resource-policy:
keep`` because no release manifest holds it (a Secret rendered by an older
chart is kept through the upgrade that stops rendering it). ``patch`` (a
post-install/post-upgrade hook) writes its ``ca.crt`` into the caBundle of
every webhook of the MutatingWebhookConfiguration. Both only read and write
those two named objects. Exit 0 done, 1 the API refused, 2 bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from collections.abc import Mapping
from typing import Any

from kv_offload_sidecar.usage import UsageError

KEEP = {"helm.sh/resource-policy": "keep"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("create", "patch"),
                        help="create: write the Secret unless it already serves; patch: put its CA into the "
                             "webhook configuration's caBundle")
    parser.add_argument("--namespace", required=True, help="namespace of the Secret (the release namespace)")
    parser.add_argument("--secret", required=True, help="name of the webhook's TLS Secret")
    parser.add_argument("--dns-name", action="append", default=[], metavar="NAME",
                        help="DNS name the serving certificate must carry (repeatable; create)")
    parser.add_argument("--validity-days", type=int, default=3650, metavar="D",
                        help="validity of a new CA and certificate in days (create; default 3650)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="label of a created Secret (repeatable; create)")
    parser.add_argument("--webhook-configuration", default=None, metavar="NAME",
                        help="the MutatingWebhookConfiguration whose caBundle to set (patch)")


def run(args: argparse.Namespace) -> int:
    labels = dict(item.partition("=")[::2] for item in args.label)
    if args.action == "create" and not args.dns_name:
        raise UsageError("kv-offload webhook-cert create: give --dns-name (the webhook Service's names)")
    if args.action == "create" and args.validity_days < 1:
        raise UsageError(f"kv-offload webhook-cert create: --validity-days {args.validity_days} must be at least 1")
    if args.action == "patch" and not args.webhook_configuration:
        raise UsageError("kv-offload webhook-cert patch: give --webhook-configuration NAME")
    if any(not key for key in labels):
        raise UsageError(f"kv-offload webhook-cert: --label takes KEY=VALUE, got {args.label}")
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        said = asyncio.run(_create(args, labels) if args.action == "create" else _patch(args))
    except ApiException as exc:
        print(f"kv-offload webhook-cert {args.action}: the API server refused ({exc.status} {exc.reason}): "
              f"{' '.join(str(exc.body or '').split())[:300]}", file=sys.stderr)
        return 1
    except Exception as exc:  # kopf.PermanentError from api_client: no credentials
        print(f"kv-offload webhook-cert {args.action}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(said)
    return 0


def _b64(pair: Mapping[str, bytes]) -> dict[str, str]:
    return {key: base64.b64encode(value).decode() for key, value in pair.items()}


async def _create(args: argparse.Namespace, labels: Mapping[str, str]) -> str:
    from kubernetes_asyncio import client as k8s

    from ..kube_api import MERGE_PATCH, api_client, read_or_none
    from ..webhook.certificate import decode_secret_data, new_pair, pair_problem

    where = f"Secret {args.namespace}/{args.secret}"
    async with await api_client() as api:
        core = k8s.CoreV1Api(api)
        current = await read_or_none(core.read_namespaced_secret, args.secret, args.namespace)
        if current is None:
            pair = new_pair(args.dns_name[0], args.dns_name, args.validity_days)
            await core.create_namespaced_secret(args.namespace, {
                "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": args.secret, "namespace": args.namespace, "labels": labels,
                             "annotations": KEEP},
                "data": _b64(pair)})
            return f"{where}: created a new CA and serving certificate for {', '.join(args.dns_name)}."
        problem = pair_problem(decode_secret_data(current.data), args.dns_name)
        annotations = current.metadata.annotations or {}
        body: dict[str, Any] = {"metadata": {}}
        if current.metadata.resource_version:  # the write fails (409) if the Secret changed meanwhile
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
        if problem is None:
            if annotations.get("helm.sh/resource-policy") == "keep":
                return f"{where}: its certificate serves {', '.join(args.dns_name)}; kept as it is."
            body["metadata"]["annotations"] = KEEP
            await core.patch_namespaced_secret(args.secret, args.namespace, body, _content_type=MERGE_PATCH)
            return f"{where}: its certificate serves {', '.join(args.dns_name)}; kept, now annotated {KEEP}."
        body["metadata"]["annotations"] = KEEP
        body["data"] = _b64(new_pair(args.dns_name[0], args.dns_name, args.validity_days))
        await core.patch_namespaced_secret(args.secret, args.namespace, body, _content_type=MERGE_PATCH)
        return f"{where}: replaced its certificate ({problem}) with a new CA and serving certificate."


async def _patch(args: argparse.Namespace) -> str:
    from kubernetes_asyncio import client as k8s

    from ..kube_api import MERGE_PATCH, api_client

    async with await api_client() as api:
        secret = await k8s.CoreV1Api(api).read_namespaced_secret(args.secret, args.namespace)
        ca = (secret.data or {}).get("ca.crt")
        if not ca:
            raise RuntimeError(f"Secret {args.namespace}/{args.secret} has no ca.crt: run "
                               f"`kv-offload webhook-cert create` first (the chart's pre-install Job)")
        admission = k8s.AdmissionregistrationV1Api(api)
        config = api.sanitize_for_serialization(
            await admission.read_mutating_webhook_configuration(args.webhook_configuration))
        webhooks = config.get("webhooks") or []
        if all((w.get("clientConfig") or {}).get("caBundle") == ca for w in webhooks):
            return f"MutatingWebhookConfiguration {args.webhook_configuration}: caBundle already current."
        for webhook in webhooks:
            webhook.setdefault("clientConfig", {})["caBundle"] = ca
        body: dict[str, Any] = {"webhooks": webhooks}
        version = (config.get("metadata") or {}).get("resourceVersion")
        if version:  # the whole list is written: fail (409) rather than undo a concurrent change
            body["metadata"] = {"resourceVersion": version}
        await admission.patch_mutating_webhook_configuration(args.webhook_configuration, body,
                                                             _content_type=MERGE_PATCH)
        return (f"MutatingWebhookConfiguration {args.webhook_configuration}: caBundle of "
                f"{len(webhooks)} webhook(s) set from Secret {args.namespace}/{args.secret}.")
