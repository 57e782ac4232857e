"""The vLLM releases kv-offload supports, and what differs between them for a translation.

A pool's engines build their ``OffloadingConfig`` with their own release's
``build_offloading_config``, so the translation applies that release's rules
(``VllmRelease``). Which release a pool runs: the vLLM image's tag when it
names one (``release_of_image``: ``vllm/vllm-openai:v0.34.0`` is 0.34), else
the pool's ``spec.vllmVersion``, else ``NEWEST``. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UnsupportedRelease(ValueError):
    """A vLLM version kv-offload has no rules for; str() says which ones it has."""


@dataclass(frozen=True)
class VllmRelease:
    # "X.Y", e.g. "0.34" (patch releases share their minor release's rules).
    version: str
    # CacheConfig.DEFAULT_BLOCK_SIZE: tokens per GPU block when --block-size is absent
    # (what FlashAttention on CUDA runs with).
    default_block_size: int
    # Whether the V1 model runner exists: VLLM_USE_V2_MODEL_RUNNER=0 selects it, and
    # build_offloading_config marks a single head-sharded full-attention group on it
    # parallelism-agnostic. False: any VLLM_USE_V2_MODEL_RUNNER but 1 stops vLLM at start,
    # and only canonical_layout makes a config parallelism-agnostic.
    v1_model_runner: bool
    # Whether EAGLE/MTP speculative decoding hashes lookahead tokens into the block hashes
    # (VllmConfig._resolve_num_hash_lookahead_tokens), so chunk keys change with it.
    hash_lookahead: bool


RELEASES: dict[str, VllmRelease] = {
    "0.32": VllmRelease("0.32", default_block_size=16, v1_model_runner=True,
                        hash_lookahead=False),
    "0.33": VllmRelease("0.33", default_block_size=16, v1_model_runner=True,
                        hash_lookahead=False),
    "0.34": VllmRelease("0.34", default_block_size=64, v1_model_runner=False,
                        hash_lookahead=True),
}
NEWEST = "0.34"
# vLLM 0.34's validate_environ message for a V1-runner line (its {value} filled in).
V1_RUNNER_REMOVED = ("VLLM_USE_V2_MODEL_RUNNER={value} is no longer supported: "
                     "Model Runner V1 has been removed. Unset this variable.")

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.\d+)?(?:(?:rc|post|dev|[-+_.])[0-9A-Za-z._+-]*)?$")


def supported() -> str:
    """The supported releases, for messages: "0.32, 0.33, 0.34"."""
    return ", ".join(RELEASES)


def minor_version(text: str) -> str | None:
    """ "X.Y" of a version string ("0.34", "0.34.1", "v0.34.0-cu129"), or None if it names none."""
    m = _VERSION.match(text.strip())
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def release(version: str | None) -> VllmRelease:
    """The rules of ``version`` ("X.Y" or "X.Y.Z"; None: the newest supported release).

    UnsupportedRelease names the supported ones."""
    if version is None:
        return RELEASES[NEWEST]
    minor = minor_version(str(version))
    if minor not in RELEASES:
        raise UnsupportedRelease(
            f"vLLM {version} is not a release kv-offload supports: use one of {supported()}")
    return RELEASES[minor]


def release_of_image(image: str | None) -> str | None:
    """The "X.Y" release a container image's tag names (``vllm/vllm-openai:v0.34.0``,
    ``registry:5000/vllm:0.33.1-cu128``), or None when the tag names none (``latest``,
    ``nightly-abc``, a digest only, no tag)."""
    if not image:
        return None
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    return minor_version(last.rsplit(":", 1)[1])


def pool_release(image: str | None, spec_version: str | None) -> tuple[VllmRelease, str]:
    """(release, where it came from) for a pool: the image's tag when it names a release,
    else ``spec.vllmVersion``, else the newest supported release."""
    from_image = release_of_image(image)
    if from_image is not None:
        return release(from_image), f"the vLLM image tag ({image})"
    if spec_version:
        return release(spec_version), f"spec.vllmVersion ({spec_version})"
    return release(None), f"the newest supported release ({NEWEST})"


__all__ = ["NEWEST", "RELEASES", "UnsupportedRelease", "V1_RUNNER_REMOVED", "VllmRelease",
           "minor_version", "pool_release", "release", "release_of_image", "supported"]
