"""Normalized configuration consumed by native offloading backends.

The frozen structs mirror vLLM's ``vllm/v1/kv_offload/config.py`` field for
field. This module also owns the JSON form written into the pool ConfigMap,
the pool fingerprint (compatible with vLLM's P2P tier) and the identity diff.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

FINGERPRINT_HEX_LEN = 16
NAMESPACE_DIGEST_HEX_LEN = 12
# SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT (mmap.PAGESIZE on x86-64 / arm64 4K).
HOST_PAGE_BYTES = 4096
# vLLM's CANONICAL_FORMAT_VERSION (distributed/kv_transfer/kv_connector/v1/offloading/
# canonical_mapping.py), as the fingerprint records it: 1 in every supported release
# (0.32.0, 0.33.0, 0.34.0); vLLM's main branch has moved on to 2, which no release carries.
CANONICAL_FORMAT_VERSION = 1
# Legacy family spellings of vLLM's canonical_format_id.
_CANONICAL_FAMILY = {"LBNHC": "nhd", "LBHNC": "hnd"}


@dataclass(frozen=True)
class OffloadingGroupConfig:
    # Total token span covered by one block across all workers
    # (accounts for context parallelism).
    tokens_per_block: int
    # Layer names belonging to this group.
    layer_names: tuple[str, ...]
    # Original KVCacheConfig group index.
    group_id: int


@dataclass(frozen=True)
class OffloadingModelConfig:
    # Model identifier (e.g. HuggingFace model path).
    name: str
    # KV cache data type (e.g. "float16").
    dtype: str


@dataclass(frozen=True)
class OffloadingCacheConfig:
    # Tokens per block hash.
    tokens_per_hash: int
    # Blocks coalesced into one offload chunk.
    blocks_per_chunk: int


@dataclass(frozen=True)
class OffloadingParallelConfig:
    # Worker index in [0, world_size). 0 on the scheduler side.
    rank: int
    # Total number of workers.
    world_size: int
    # Tensor parallel size.
    tp_size: int
    # Pipeline parallel size.
    pp_size: int
    # Prefill context parallel size.
    pcp_size: int
    # Decode context parallel size.
    dcp_size: int
    # Data parallel replica index of this engine.
    data_parallel_index: int
    # Number of data parallel replicas.
    data_parallel_size: int
    # Local rank of the data parallel group, set only in SPMD mode.
    data_parallel_rank_local: int | None
    # True when the bytes that will be persisted for a block are portable
    # across parallelism configurations: for the direct layout, concatenating
    # the block's data across all workers in rank order yields the same bytes
    # under any topology; for the canonical layout, the canonical page itself
    # is topology-free.
    is_parallelism_agnostic: bool


@dataclass(frozen=True)
class OffloadingConfig:
    groups: tuple[OffloadingGroupConfig, ...]
    # KV bytes stored by one worker per block.
    worker_kv_bytes_per_block: int
    # Whether the scheduler emits KV cache events. When true,
    # the offloading backend should emit events as well.
    enable_kv_cache_events: bool
    # Offloading-specific configuration from kv_connector_extra_config.
    extra_config: Mapping[str, Any]
    # Unique identifier for this engine, distinct per DP rank.
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    # True when the offloaded bytes of every worker are expected to be
    # byte-identical per block (pure-MLA model, single-node TP-only
    # parallelism), enabling a single-copy host layout in backends that
    # support it.
    replicated_layout: bool = False
    # True when the canonical per-layer host byte layout was requested via
    # kv_connector_extra_config; certified per-layer at worker registration.
    canonical_layout: bool = False
    # Resolved KVCacheLayout name of the worker KV cache.
    kv_cache_layout: str | None = None

    def __post_init__(self) -> None:
        # Freeze extra_config so a loaded config equals the one it came from.
        object.__setattr__(self, "extra_config", freeze(self.extra_config or {}))

    # ---- derived quantities -------------------------------------------

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens covered by one chunk of the first group (e.g. 64)."""
        return self.groups[0].tokens_per_block * self.cache.blocks_per_chunk

    @property
    def hashes_per_chunk(self) -> int:
        """Prefix hashes per chunk: tokens_per_chunk // tokens_per_hash."""
        return self.tokens_per_chunk // self.cache.tokens_per_hash

    @property
    def kv_bytes_per_chunk(self) -> int:
        """Bytes of one chunk across all workers of one engine.

        With the replicated layout every worker holds the same bytes, so
        one copy is stored.
        """
        workers = 1 if self.replicated_layout else self.parallel.world_size
        return self.worker_kv_bytes_per_block * self.cache.blocks_per_chunk * workers

    @property
    def host_chunk_stride_bytes(self) -> int:
        """Bytes vLLM's CPU tier reserves per chunk: kv_bytes_per_chunk rounded
        up to the 4 KiB page (CPUOffloadingSpec's aligned_kv_bytes_per_chunk)."""
        return -(-self.kv_bytes_per_chunk // HOST_PAGE_BYTES) * HOST_PAGE_BYTES

    # ---- identity -------------------------------------------------------

    def run_config(self) -> dict[str, Any]:
        """vLLM's FileMapper run-config dict, built as its P2P tier does.

        Equivalent to ``FileMapper.from_offloading_spec(root_dir="", spec,
        blocks_per_file=blocks_per_chunk, parallel_agnostic=True)
        .get_run_config()``.
        """
        agnostic = self.parallel.is_parallelism_agnostic or self.replicated_layout
        p = self.parallel
        tp, pp, pcp, dcp = (1, 1, 1, 1) if agnostic else (
            p.tp_size, p.pp_size, p.pcp_size, p.dcp_size)
        fields: dict[str, Any] = {
            "model_name": self.model.name,
            "tokens_per_hash": self.cache.tokens_per_hash,
            "blocks_per_file": self.cache.blocks_per_chunk,
            "tp_size": tp,
            "pp_size": pp,
            "pcp_size": pcp,
            "dcp_size": dcp,
            "dtype": str(self.model.dtype),
            "kv_cache_groups": [
                {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
                for g in self.groups
            ],
            "inference_engine": "vllm",
        }
        if not agnostic:
            fields["parallel_agnostic"] = False
        if self.replicated_layout:
            fields["replicated_layout"] = True
        if self.canonical_layout:
            if self.kv_cache_layout is None:
                raise ValueError(
                    "canonical_layout is true but kv_cache_layout is unset: "
                    "set kv_cache_layout (e.g. 'LBNHC') to name the canonical family.")
            fields["canonical_format"] = canonical_format_id(self.kv_cache_layout)
        return fields

    def _identity_hash(self) -> str:
        canonical = json.dumps(self.run_config(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @property
    def fingerprint(self) -> str:
        """First 16 hex of sha256 over the run config (vLLM's P2P fingerprint)."""
        return self._identity_hash()[:FINGERPRINT_HEX_LEN]

    @property
    def namespace_digest(self) -> str:
        """First 12 hex of the same hash (vLLM's FileMapper namespace digest)."""
        return self._identity_hash()[:NAMESPACE_DIGEST_HEX_LEN]

    # ---- JSON -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the struct field names plus fingerprint and digest."""
        d = asdict(self)
        d["extra_config"] = _plain(self.extra_config)
        d["fingerprint"] = self.fingerprint
        d["namespace_digest"] = self.namespace_digest
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OffloadingConfig":
        """Load a config dict; a stated fingerprint must match the content."""
        if not isinstance(d, Mapping):
            raise ValueError(f"offloading config must be a JSON object, got {type(d).__name__}")
        groups = _req(d, "groups")
        if not isinstance(groups, list) or not groups:
            raise ValueError("offloading config field 'groups' must be a non-empty list")
        try:
            cfg = cls(
                groups=tuple(
                    OffloadingGroupConfig(
                        tokens_per_block=_int(g, "tokens_per_block"),
                        layer_names=tuple(_str(n, "layer_names") for n in _list(g, "layer_names")),
                        group_id=_int(g, "group_id"),
                    )
                    for g in groups
                ),
                worker_kv_bytes_per_block=_int(d, "worker_kv_bytes_per_block"),
                enable_kv_cache_events=_bool(d, "enable_kv_cache_events"),
                extra_config=_mapping(d, "extra_config"),
                engine_id=_str(_req(d, "engine_id"), "engine_id"),
                model=OffloadingModelConfig(
                    name=_str(_req(_req(d, "model"), "name"), "model.name"),
                    dtype=_str(_req(_req(d, "model"), "dtype"), "model.dtype"),
                ),
                cache=OffloadingCacheConfig(**{
                    k: _int(_req(d, "cache"), k) for k in ("tokens_per_hash", "blocks_per_chunk")}),
                parallel=_parallel_from(_req(d, "parallel")),
                replicated_layout=_bool(d, "replicated_layout", False),
                canonical_layout=_bool(d, "canonical_layout", False),
                kv_cache_layout=_optional_str(d, "kv_cache_layout"),
            )
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"malformed offloading config: {exc}") from None
        if cfg.cache.tokens_per_hash <= 0 or cfg.cache.blocks_per_chunk <= 0 or any(
                g.tokens_per_block <= 0 for g in cfg.groups):
            raise ValueError("offloading config tokens_per_block, tokens_per_hash and "
                             "blocks_per_chunk must be greater than 0")
        for key in ("fingerprint", "namespace_digest"):
            stated = d.get(key)
            if stated is not None and stated != getattr(cfg, key):
                raise ValueError(
                    f"offloading config states {key} {stated!r} but its fields hash to "
                    f"{getattr(cfg, key)!r}: regenerate it with 'kv-offload translate'")
        return cfg

    @classmethod
    def from_json(cls, text: str) -> "OffloadingConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"offloading config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def __hash__(self) -> int:  # extra_config is a Mapping: hash the identity
        return hash(self.to_json(indent=None))


def canonical_format_id(kv_cache_layout: str) -> str:
    """vLLM's canonical_format_id: ``f"v{CANONICAL_FORMAT_VERSION}-" + family``."""
    family = _CANONICAL_FAMILY.get(kv_cache_layout, kv_cache_layout.lower())
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


def identity_diff(a: OffloadingConfig | Mapping[str, Any],
                  b: OffloadingConfig | Mapping[str, Any]) -> list[str]:
    """Every identity field that differs, as ``"name: a != b"`` lines.

    Identity is the fingerprint's run config; the kv_bytes_per_chunk that
    the peer handshake also compares is listed too.
    """
    ra = a.run_config() if isinstance(a, OffloadingConfig) else dict(a)
    rb = b.run_config() if isinstance(b, OffloadingConfig) else dict(b)
    if isinstance(a, OffloadingConfig) and isinstance(b, OffloadingConfig):
        ra = {**ra, "kv_bytes_per_chunk": a.kv_bytes_per_chunk}
        rb = {**rb, "kv_bytes_per_chunk": b.kv_bytes_per_chunk}
    out: list[str] = []
    for key in sorted(set(ra) | set(rb)):
        va, vb = ra.get(key, _ABSENT), rb.get(key, _ABSENT)
        if key == "kv_cache_groups" and va != vb and isinstance(va, list) and isinstance(vb, list):
            out.extend(_group_diff(va, vb))
        elif va != vb:
            out.append(f"{key}: {_show(va)} != {_show(vb)}")
    return out


def _group_diff(ga: list, gb: list) -> list[str]:
    if len(ga) != len(gb):
        return [f"kv_cache_groups: {len(ga)} groups != {len(gb)} groups"]
    out = []
    for i, (x, y) in enumerate(zip(ga, gb)):
        for key in ("tokens_per_block", "layer_names"):
            if x.get(key) != y.get(key):
                vx, vy = x.get(key), y.get(key)
                if key == "layer_names":
                    vx, vy = f"{len(vx or [])} layers {_abbrev(vx)}", f"{len(vy or [])} layers {_abbrev(vy)}"
                out.append(f"kv_cache_groups[{i}].{key}: {vx} != {vy}")
    return out


def _abbrev(names: list | None) -> str:
    names = list(names or [])
    if len(names) <= 2:
        return str(names)
    return f"[{names[0]!r} .. {names[-1]!r}]"


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _show(v: Any) -> str:
    if v is _ABSENT:
        return repr(v)
    return json.dumps(v) if isinstance(v, (str, bool)) or v is None else str(v)


def _req(d: Any, key: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise ValueError(f"offloading config is missing field {key!r}")
    return d[key]


def _int(d: Any, key: str) -> int:
    v = _req(d, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"offloading config field {key!r} must be an integer, got {v!r}")
    return v


def _str(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"offloading config field {key!r} must be a string, got {v!r}")
    return v


def _optional_str(d: Mapping[str, Any], key: str) -> str | None:
    v = d.get(key)
    return None if v is None else _str(v, key)


def _bool(d: Mapping[str, Any], key: str, default: bool | None = None) -> bool:
    v = d.get(key, default) if default is not None else _req(d, key)
    if not isinstance(v, bool):
        raise ValueError(f"offloading config field {key!r} must be true or false, got {v!r}")
    return v


def _list(d: Any, key: str) -> list:
    v = _req(d, key)
    if not isinstance(v, list):
        raise ValueError(f"offloading config field {key!r} must be a list, got {v!r}")
    return v


def _mapping(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = _req(d, key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"offloading config field {key!r} must be an object, got {v!r}")
    return v


def _parallel_from(p: Mapping[str, Any]) -> OffloadingParallelConfig:
    ints = ("rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size",
            "data_parallel_index", "data_parallel_size")
    local = p.get("data_parallel_rank_local") if isinstance(p, Mapping) else None
    return OffloadingParallelConfig(
        **{k: _int(p, k) for k in ints},
        data_parallel_rank_local=None if local is None else _int(p, "data_parallel_rank_local"),
        is_parallelism_agnostic=_bool(p, "is_parallelism_agnostic"),
    )


class _FrozenDict(dict):
    """A read-only dict: extra_config stays immutable inside a frozen config."""

    def _readonly(self, *a: Any, **k: Any) -> None:
        raise TypeError("extra_config is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore


def freeze(v: Any) -> Any:
    """Deep read-only copy: mappings become read-only dicts, lists tuples."""
    if isinstance(v, Mapping):
        return _FrozenDict({k: freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def load_config_file(path: str) -> OffloadingConfig:
    """Read a ConfigMap-style JSON file; errors name the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"cannot read offloading config {path!r}: {exc.strerror}") from None
    try:
        return OffloadingConfig.from_json(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
