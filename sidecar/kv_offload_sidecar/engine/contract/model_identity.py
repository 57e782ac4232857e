"""The model identity: everything beyond the fingerprint that changes a chunk's bytes.

vLLM's P2P fingerprint (``offloading_config``) names the format of a chunk: model
name, KV dtype, block geometry, parallelism, canonical layout. It does not tell two
engines apart whose bytes differ under the same format: other weights at the same
model name or path (a rolling update to retrained weights), another ``--revision``,
quantization, ``--hf-overrides`` (RoPE scaling), another attention backend's layout.
``ModelIdentity`` holds those fields; two pods share chunks only when their
fingerprints *and* identities are equal.

Contract:
- The engine is the source of truth: the tier inside vLLM builds the identity from
  vLLM's own config and the model it loaded (``vllm_identity``) and gives it to its
  sidecar (the local channel's ``identify``); the sidecar shares nothing before.
- ``DECLARED_FIELDS`` are the fields the ``vllm serve`` command line determines;
  ``kv-offload translate`` writes the ones the command line states into the pool's
  ConfigMap (``model_identity``), and a sidecar refuses an engine whose identity
  differs from them (``declared_mismatches``).
- What does not change the bytes is not a field: serving flags, the tokenizer and the
  chat template (the KV is a function of token ids, weights and the positional config).
- ``digest`` is the first 16 hex of sha256 over the canonical JSON of the fields;
  ``diff`` names each differing field (``weights: files:3f2a.. != files:9c1d..``).
- An empty ``weights`` means the weights could not be identified: such an identity
  equals no other (``comparable``), so a pod that cannot tell its weights shares nothing.
- ``from_dict`` validates input from strangers (peers' hellos): string fields only,
  each at most ``MAX_FIELD_CHARS``, unknown fields rejected.
Standard library only (it runs inside vLLM, in the sidecar and in the operator).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

DIGEST_HEX_LEN = 16
# Longest accepted value of one field from a peer or an engine.
MAX_FIELD_CHARS = 512


@dataclass(frozen=True)
class ModelIdentity:
    # The weights: "hf:<repo>@<commit>" (a hub snapshot), "files:<16 hex>" (a digest of a
    # local directory's weight files, ``weights_digest``) or "" (unknown: shares nothing).
    weights: str = ""
    # --revision (the weights' hub revision as asked; "" when not given).
    revision: str = ""
    # --code-revision ("" when not given).
    code_revision: str = ""
    # The quantization method vLLM runs ("" for none), from --quantization or the model's config.
    quantization: str = ""
    # --hf-overrides as canonical JSON ("" when not given; ``overrides_text``).
    hf_overrides: str = ""
    # 16 hex of the effective model config (config.json after overrides: RoPE and the rest).
    model_config: str = ""
    # The model's compute dtype ("bfloat16", "float16", ...).
    dtype: str = ""
    # The KV cache dtype vLLM stores ("auto" resolved: the model's dtype, else e.g. "fp8_e4m3").
    kv_cache_dtype: str = ""
    # The KV layout of the attention backend the engine runs: the canonical format id under
    # the canonical layout, else "<backend>/<layout>/<device>".
    kv_layout: str = ""
    # vLLM's release (major.minor) where its layout is not canonical ("" under the canonical layout).
    vllm_release: str = ""
    # Tokens per KV block (--block-size as vLLM resolved it).
    block_size: str = ""
    # The prefix-caching hash algorithm (--prefix-caching-hash-algo).
    hash_algo: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def digest(self) -> str:
        """First 16 hex of sha256 over the canonical JSON of every field."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_HEX_LEN]

    @property
    def comparable(self) -> bool:
        """Whether this identity can equal another: its weights are known."""
        return bool(self.weights)

    def diff(self, other: ModelIdentity | None) -> list[str]:
        """Every field that differs, as ``"name: mine != theirs"`` lines (unknown weights too)."""
        if other is None:
            return [f"model_identity: {self.digest} != <none: the engine has not attached>"]
        out = [f"{f.name}: {_shown(getattr(self, f.name))} != {_shown(getattr(other, f.name))}"
               for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if not out and not (self.comparable and other.comparable):
            out.append("weights: <unknown> != <unknown> (weights that cannot be identified "
                       "are never shared)")
        return out

    def statement(self, fingerprint: str | None = None) -> dict[str, Any]:
        """What an engine states to its sidecar with every ``info`` (``EngineClient(states=)``):
        this identity and, when given, the engine's fingerprint."""
        return {"model_identity": self.to_dict(),
                **({} if fingerprint is None else {"fingerprint": fingerprint})}

    def matches(self, other: ModelIdentity | None) -> bool:
        """Equal, with known weights: chunks of one are chunks of the other."""
        return other is not None and self.comparable and self == other

    @classmethod
    def from_dict(cls, d: Any) -> ModelIdentity:
        """Parse an identity from JSON; ``ValueError`` naming the field when it is malformed."""
        if not isinstance(d, Mapping):
            raise ValueError(f"model identity must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k)[:64] for k in d if k not in names)
        if unknown:
            raise ValueError(f"model identity has unknown field(s) {unknown[:8]}; valid fields: "
                             f"{', '.join(sorted(names))}")
        values: dict[str, str] = {}
        for name in names:
            v = d.get(name, "")
            if not isinstance(v, str):
                raise ValueError(f"model identity field {name!r} must be a string, got "
                                 f"{type(v).__name__}")
            if len(v) > MAX_FIELD_CHARS:
                raise ValueError(f"model identity field {name!r} is longer than "
                                 f"{MAX_FIELD_CHARS} characters")
            values[name] = v
        return cls(**values)


# The fields the ``vllm serve`` command line determines (written by ``kv-offload translate``
# where the command line states them, and checked by the sidecar against its engine's).
DECLARED_FIELDS = ("revision", "code_revision", "quantization", "hf_overrides", "dtype",
                   "kv_cache_dtype", "block_size", "hash_algo")


def declared_mismatches(engine: ModelIdentity, declared: Mapping[str, str]) -> list[str]:
    """Each declared field the engine's identity contradicts, as ``"name: engine != config"``.

    A field the config does not state (absent or "") is not compared: the command line
    left it to vLLM, and only the engine knows what vLLM chose.
    """
    out = []
    for name in DECLARED_FIELDS:
        want = declared.get(name, "")
        have = getattr(engine, name)
        if want and want != have:
            out.append(f"{name}: {_shown(have)} != {_shown(want)}")
    return out


def parse_declared(d: Any) -> dict[str, str]:
    """The declared part of a ConfigMap's ``model_identity`` (only ``DECLARED_FIELDS``, strings)."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ValueError(f"offloading config field 'model_identity' must be an object, got {d!r}")
    out: dict[str, str] = {}
    for k, v in d.items():
        if k not in DECLARED_FIELDS:
            raise ValueError(f"offloading config field 'model_identity' has unknown key {k!r}; "
                             f"valid keys: {', '.join(DECLARED_FIELDS)}")
        if not isinstance(v, str):
            raise ValueError(f"offloading config field 'model_identity.{k}' must be a string, "
                             f"got {v!r}")
        if v:
            out[k] = v
    return out


def declared_in_file(path: str) -> dict[str, str]:
    """The declared identity of a ConfigMap-style offloading_config.json ({} when it has none).

    ``ValueError`` names the file; the config itself is checked by ``load_config_file``."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model identity of {path!r}: {exc}") from None
    try:
        return parse_declared(data.get("model_identity") if isinstance(data, Mapping) else None)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def overrides_text(value: Any) -> str:
    """``--hf-overrides`` as the identity records it: its canonical JSON, or (past
    ``MAX_FIELD_CHARS // 2``) ``sha256:<16 hex>`` of it; "" for none."""
    if not value:
        return ""
    text = canonical_json(value)
    if len(text) <= MAX_FIELD_CHARS // 2:
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_HEX_LEN]


def canonical_json(value: Any) -> str:
    """The one spelling of a JSON value (sorted keys, no spaces) the identity records."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def short(text: str) -> str:
    """A value as a diff line shows it (long digests and JSON cut to 40 characters)."""
    return text if len(text) <= 40 else text[:37] + "..."


def _shown(value: str) -> str:
    return short(value) if value else "<none>"


__all__ = ["DECLARED_FIELDS", "ModelIdentity", "canonical_json", "declared_in_file",
           "declared_mismatches", "overrides_text", "parse_declared"]
