"""A pool that pins its sidecar image (``spec.sidecar.image``) runs a release this operator can drive, or is refused.

The webhook gives a sidecar this operator's flags, environment and ConfigMap
(``webhook/pod_patch.py``, ``pool_objects.configmap_for``). The sidecar
releases that accept them are this one and the one before it (N-1, as the
wire window: ``kv_offload_sidecar.peers.wire_window``), from
``OLDEST_SIDECAR_VERSION`` to this package's version; ``tests/tools/test_previous_release.py``
runs the last release's sidecar on this operator's translation. A release that
changes what the webhook passes in a way the previous release refuses raises
``OLDEST_SIDECAR_VERSION`` to its own version.

``check`` reads the version from the image tag (``kv-offload:0.1.0``,
``registry:5000/kv-offload:v0.2.1-cuda``; with both a tag and a digest, the tag):

- a pinned version inside the window, or no pin (the operator's own image):
  ``SidecarImage=True``;
- a pinned version outside it: the pool is refused (``Invalid=True`` with the
  message, a Warning Event ``SidecarImageUnsupported``, ``SidecarImage=False``),
  naming the image, its version and the window, so the webhook denies its
  pods with that sentence instead of creating pods whose sidecar exits 2 on
  flags it does not know and keeps vLLM from starting;
- a tag that names no version (``latest``, ``dev``, a digest only):
  accepted, ``SidecarImage=Unknown`` reason ``Unchecked`` saying so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload_sidecar import __version__

# The oldest sidecar release this operator's translation works with: the previous release's
# (kv_offload_tools.previous_release.LAST_RELEASE, d0dde59, version 0.1.0).
OLDEST_SIDECAR_VERSION = "0.1.0"
# The newest: this release.
NEWEST_SIDECAR_VERSION = __version__
# The pool condition type.
CONDITION = "SidecarImage"
# The Warning Event reason of a refused image.
REFUSED_EVENT = "SidecarImageUnsupported"
# A release in an image tag: "0.1.0", "v0.1.0", "0.1.0-cuda12"; the rest after - or + is ignored.
_TAG_VERSION = re.compile(r"^v?(\d{1,5})\.(\d{1,5})\.(\d{1,5})(?:[-+].*)?$")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a release such as "0.1.0", else None."""
    m = _TAG_VERSION.match(text)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def image_tag(image: str) -> str | None:
    """The tag of an image reference (``repo:tag``, ``host:5000/repo:tag@sha256:...``), else None."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else None


@dataclass(frozen=True)
class ImageCheck:
    """What the operator makes of a pool's sidecar image: the ``SidecarImage`` condition."""

    # "True" (a release this operator drives), "False" (refused) or "Unknown" (no version to check).
    status: str
    # The condition's reason: OperatorImage, Supported, Unsupported or Unchecked.
    reason: str
    # One sentence naming the image, its version and the supported window.
    message: str

    @property
    def refused(self) -> bool:
        return self.status == "False"


def supported_range() -> str:
    return f"kv-offload {OLDEST_SIDECAR_VERSION} to {NEWEST_SIDECAR_VERSION}"


def check(spec: Mapping[str, Any]) -> ImageCheck:
    """The check of the pool ``spec``'s ``sidecar.image`` (see the module docstring)."""
    image = str((spec.get("sidecar") or {}).get("image") or "")
    if not image:
        return ImageCheck("True", "OperatorImage", "The pool runs the operator's own sidecar image.")
    tag = image_tag(image)
    version = parse_version(tag) if tag else None
    if version is None:
        names = f"its tag {tag!r} names no release" if tag else "it has no tag (a digest only, or none)"
        return ImageCheck("Unknown", "Unchecked",
                          f"spec.sidecar.image {image!r} is unchecked: {names}, so this operator cannot tell "
                          f"whether it is one of the sidecar releases it drives ({supported_range()}); a "
                          f"sidecar outside them may refuse the flags it is given. Pin a versioned tag "
                          f"to have it checked.")
    shown = ".".join(map(str, version))
    oldest, newest = parse_version(OLDEST_SIDECAR_VERSION), parse_version(NEWEST_SIDECAR_VERSION)
    assert oldest is not None and newest is not None
    if oldest <= version <= newest:
        return ImageCheck("True", "Supported", f"spec.sidecar.image {image!r} is kv-offload {shown}, one of "
                                               f"the sidecar releases this operator drives ({supported_range()}).")
    return ImageCheck("False", "Unsupported",
                      f"spec.sidecar.image {image!r} is kv-offload {shown}, outside the sidecar releases this "
                      f"operator (kv-offload {__version__}) drives ({supported_range()}): its sidecar would "
                      f"not accept the flags and config it is given. Pin an image in that range, or leave "
                      f"spec.sidecar.image unset to run the operator's own.")


def image_conditions(old: Sequence[Mapping[str, Any]] | None, result: ImageCheck,
                     generation: int | None, now: str) -> list[dict[str, Any]]:
    """The ``SidecarImage`` condition to append to the pool's others (``lastTransitionTime``
    moves only when its status flips)."""
    before = next((c for c in old or [] if c.get("type") == CONDITION), {})
    since = before.get("lastTransitionTime") if before.get("status") == result.status else None
    cond: dict[str, Any] = {"type": CONDITION, "status": result.status, "reason": result.reason,
                            "message": result.message, "lastTransitionTime": since or now}
    if generation is not None:
        cond["observedGeneration"] = generation
    return [cond]
