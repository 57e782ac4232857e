"""The pool config a sidecar starts on: the ``--config`` file, else the last good one this pod had.

The sidecar reads the pool's config (``--config``: the operator's ConfigMap,
``offloading_config.json``, mounted by the webhook and updated in place by the
kubelet) when it starts. A hand edit of that ConfigMap is reverted by the
operator within seconds (its drift check: ``pools/drift.py``), but a sidecar
container that restarts in those seconds would read it. So a bad edit never
takes a running pod's sidecar (and with it vLLM) down:

- A sidecar that serves writes the config it runs to ``last_good_path``
  (``keep``): ``<shm-dir>/kv-offload-<identity>.last-good-config.json``. ``--shm-dir`` is
  the pod's ``/dev/shm``, an emptyDir that lives as long as the pod, so a sidecar that
  was killed, ran out of memory, crashed or was restarted by its liveness probe
  (SIGTERM) finds it when its container restarts. In a pod (``KUBERNETES_SERVICE_HOST``
  set, as the kubelet sets it in every container) a clean stop keeps it: the pod's
  ``/dev/shm`` goes with the pod. Elsewhere (a developer's host, whose ``/dev/shm``
  outlives every run) a clean stop removes it (``forget``, as it unlinks its store).
- A start whose file does not load runs the saved config instead and says so:
  one warning line naming the file, the problem (``load_config_file``'s message:
  the key, the value and what it must be) and the fingerprint it keeps,
  ``kv_offload_config_rejected`` 1, and ``/v1/status``'s ``"config"``
  (``config_view``: ``source`` ``"last_good"`` and ``rejected``, the problem).
- With no saved config (the pod's first start) or a saved one that does not load
  either, a bad file fails as it always did: one line on stderr, exit 2.

A file that loads always wins, even with another fingerprint, and replaces the saved
one once the sidecar serves. Keys of the file this release does not know (a newer operator's)
are ignored with one warning naming them (``unknown_keys``), so an older
pinned sidecar image runs a newer operator's config as far as it understands
it; a key that changes the fingerprint still fails the stated-fingerprint check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kv_offload_sidecar.engine.contract.model_identity import parse_declared
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig

log = logging.getLogger("kv_offload_sidecar")

# Suffix of the saved config's file name in --shm-dir, after "kv-offload-<identity>".
LAST_GOOD_SUFFIX = ".last-good-config.json"
# Top-level keys of offloading_config.json besides OffloadingConfig's fields.
EXTRA_KEYS = ("fingerprint", "namespace_digest", "model_identity")
# Where the config a sidecar runs came from (/v1/status "config" "source").
SOURCES = ("file", "last_good")


@dataclass(frozen=True)
class PoolConfig:
    """The config a sidecar starts on, and where it came from."""

    # The offloading config the sidecar runs.
    config: OffloadingConfig
    # Its declared model identity (the file's "model_identity", engine/contract/model_identity.DECLARED_FIELDS).
    declared: Mapping[str, str] = field(default_factory=dict)
    # Why the --config file was refused at this start ("" = it was used): the sidecar
    # runs the last good config this pod saved.
    rejected: str = ""
    # Top-level keys of the file this release does not know (ignored), sorted.
    unknown: tuple[str, ...] = ()


def last_good_path(shm_dir: str, identity: str) -> str:
    """Where the sidecar ``identity`` saves its last good config (in the pod's ``shm_dir``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", identity).strip("-.") or "sidecar"
    return os.path.join(shm_dir, f"kv-offload-{name[:100]}{LAST_GOOD_SUFFIX}")


def unknown_keys(document: Any) -> tuple[str, ...]:
    """Top-level keys of a config document that this release does not read, sorted."""
    if not isinstance(document, Mapping):
        return ()
    known = {f.name for f in fields(OffloadingConfig)} | set(EXTRA_KEYS)
    return tuple(sorted(str(k) for k in document if k not in known))


def parse(text: str, where: str) -> PoolConfig:
    """The config and declared identity in ``text``; ValueError names ``where`` and the problem."""
    try:
        config = OffloadingConfig.from_json(text)
        document = json.loads(text)
        declared = parse_declared(document.get("model_identity"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return PoolConfig(config, declared, unknown=unknown_keys(document))


def load(path: str, *, saved: str | None) -> PoolConfig:
    """The pool config in ``path``, else the one ``saved`` (``last_good_path``; None: none) as
    the module docstring says; ValueError when there is none."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        problem = f"cannot read offloading config {path!r}: {exc.strerror}"
    else:
        try:
            loaded = parse(text, path)
        except ValueError as exc:
            problem = str(exc)
        else:
            if loaded.unknown:
                log.warning("%s: ignoring key(s) this sidecar release does not know: %s (a newer "
                            "operator's; they do not change what this sidecar runs)",
                            path, ", ".join(loaded.unknown))
            return loaded
    kept = _last_good(saved, problem)
    log.warning("config rejected: %s; running the last good config of this pod instead (fingerprint "
                "%s, saved in %s); a restart runs the file once it loads (the operator reverts hand "
                "edits of the pool's ConfigMap; edit the pool's spec instead)", problem,
                kept.config.fingerprint, saved)
    return PoolConfig(kept.config, kept.declared, rejected=problem, unknown=kept.unknown)


def config_view(rejected: str) -> dict[str, Any]:
    """/v1/status's ``"config"``: where the running config came from, and why the file was refused."""
    return {"source": SOURCES[1] if rejected else SOURCES[0], "rejected": rejected}


def _last_good(saved: str | None, problem: str) -> PoolConfig:
    """The saved config, else ValueError(``problem``) saying there is none to keep."""
    if saved is None:
        raise ValueError(problem)
    try:
        with open(saved, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ValueError(problem) from None  # this pod's first start: fail as always
    except OSError as exc:
        raise ValueError(f"{problem} (and the last good config {saved!r} cannot be read: "
                         f"{exc.strerror})") from None
    try:
        return parse(text, saved)
    except ValueError as exc:
        raise ValueError(f"{problem} (and the last good config does not load either: {exc})") from None


def keep(path: str, config: OffloadingConfig, declared: Mapping[str, str]) -> None:
    """Save the config a serving sidecar runs to ``path`` whole (a crash leaves the old file
    or the new one); a failure costs the fallback, not the sidecar."""
    text = json.dumps({**config.to_dict(), "model_identity": dict(declared)}, indent=2)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:  # e.g. a full /dev/shm
        log.warning("cannot save the last good config to %s: %s; a restart with a bad config "
                    "file will not start", path, exc.strerror)


# Set by the kubelet in every container: the sidecar runs in a pod, whose /dev/shm dies with it.
IN_POD_ENV = "KUBERNETES_SERVICE_HOST"


def forget(path: str, environ: Mapping[str, str] = os.environ) -> None:
    """At a clean stop: outside a pod, remove the saved config; in a pod, keep it for the
    container's restart (a liveness probe's SIGTERM is a clean stop too)."""
    if environ.get(IN_POD_ENV):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["IN_POD_ENV", "LAST_GOOD_SUFFIX", "PoolConfig", "config_view", "forget", "keep", "last_good_path", "load",
           "unknown_keys"]
