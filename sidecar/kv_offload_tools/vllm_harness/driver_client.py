"""Client for ``engine_driver`` (standard library only; usable from any venv).

Starts ``python -m kv_offload_tools.vllm_harness.engine_driver`` with a given
python executable (vLLM's venv) and environment, waits for its ready line,
then talks JSON lines to it::

    with EngineDriverProcess(model_dir, python="/tmp/vv/venv-vllm/bin/python",
                             kv_transfer_config=cfg,
                             extra_env={"PYTHONHASHSEED": "0"}) as eng:
        out = eng.generate([[1, 2, 3] * 100], max_tokens=8)
        hits = metric_value(eng.metrics(), "vllm:kv_offload_tiering_chunk_hits")

The driver runs in its own session (process group); ``close`` asks it to exit,
and after ``grace_s`` kills the whole group and removes the
``/dev/shm/vllm_offload_<engine_id>*.mmap`` file a killed engine leaves
(the process plumbing is ``json_lines_process``'s, shared with ``manager_client``).
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .json_lines_process import JsonLinesProcess, JsonLinesProcessError

__all__ = ["EngineDriverError", "EngineDriverProcess", "close_all", "metric_value",
           "metric_samples", "start_all"]

# .../sidecar (the directory holding the kv_offload_tools package)
_SIDECAR_DIR = str(Path(__file__).resolve().parents[2])


class EngineDriverError(JsonLinesProcessError):
    """The driver failed to start, died, timed out or answered with an error."""


class EngineDriverProcess(JsonLinesProcess):
    """One engine_driver subprocess, up once the constructor returns.

    Args:
        model_dir: model directory (``model.write_tiny_llama``).
        python: python executable of the vLLM venv.
        kv_transfer_config: ``KVTransferConfig`` fields; None for a baseline.
        block_size: vLLM KV block size in tokens.
        llm_kwargs: extra ``vllm.LLM`` keyword arguments.
        env: base environment (default: a copy of ``os.environ``).
        extra_env: variables set on top of ``env`` (e.g. ``PYTHONHASHSEED``).
        ready_timeout_s: how long to wait for the engine to come up.
        stderr_path: where the driver's stderr (vLLM's logs) goes; default a
            temporary file, removed on ``close`` unless the driver failed.
        shutdown_timeout_s: the driver's grace for vLLM's engine-core exit.
    """

    error_type = EngineDriverError

    def __init__(
        self,
        model_dir: str,
        *,
        python: str,
        kv_transfer_config: Mapping[str, Any] | None = None,
        block_size: int = 32,
        llm_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        stderr_path: str | None = None,
        shutdown_timeout_s: float = 30.0,
    ) -> None:
        full_env = dict(os.environ if env is None else env)
        full_env.update(extra_env or {})
        # The harness is imported from this checkout, after the caller's PYTHONPATH, so a
        # tier installed there (as the webhook installs it) wins over the checkout's copy.
        path = full_env.get("PYTHONPATH", "")
        if _SIDECAR_DIR not in path.split(os.pathsep):
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in (path, _SIDECAR_DIR) if p)
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        full_env.pop("PYTHONHOME", None)

        cmd = [python, "-m", "kv_offload_tools.vllm_harness.engine_driver",
               "--model", model_dir, "--block-size", str(block_size)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        if llm_kwargs:
            cmd += ["--llm-kwargs", json.dumps(dict(llm_kwargs))]
        cmd += ["--shutdown-timeout", str(shutdown_timeout_s)]
        self.shutdown_timeout_s = shutdown_timeout_s
        # vLLM's engine id, from the ready line (None until then; close() reads it).
        self.engine_id: str | None = None
        super().__init__(cmd, env=full_env, name="engine_driver", stderr_path=stderr_path)
        self.engine_id = self.wait_ready(ready_timeout_s).get("engine_id")

    # -- operations -----------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16,
        ignore_eos: bool = True, timeout_s: float = 120.0, *,
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy generation; per prompt ``{"token_ids", "num_cached_tokens",
        "finish_reason", "cache_salt"}``.

        ``cache_salt``: vLLM's per-request cache salt, one for every prompt (a
        string) or one per prompt (a sequence, None for no salt). Prompts with
        different salts share no block hash, hence no offloaded chunk.
        """
        cmd: dict[str, Any] = {"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                               "max_tokens": max_tokens, "ignore_eos": ignore_eos}
        if cache_salt is not None:
            salts = ([cache_salt] * len(prompts) if isinstance(cache_salt, str)
                     else list(cache_salt))
            if len(salts) != len(prompts):
                raise ValueError(f"{len(salts)} cache salts for {len(prompts)} prompts")
            cmd["cache_salts"] = salts
        reply = self.request(cmd, timeout_s)
        self.last_generate_s: float = reply.get("elapsed_s", 0.0)
        return reply["outputs"]

    def metrics(self, raw: bool = False, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """vLLM's metrics.

        ``raw=False``: ``LLM.get_metrics()`` as ``[{"name", "type", "labels",
        "value" | "count"/"sum"/"buckets"}]`` (vLLM truncates counters to int).
        ``raw=True``: the Prometheus samples ``[{"name", "labels", "value"}]``
        (names with ``_total``/``_bucket``/``_sum``/``_count``; float values).
        """
        reply = self.request({"op": "metrics"}, timeout_s)
        return reply["samples" if raw else "metrics"]

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Drop the engine's own prefix cache (offload tiers keep their data);
        ``reset_connector`` also empties vLLM's primary CPU tier (secondary tiers keep theirs)."""
        cmd: dict[str, Any] = {"op": "reset_prefix_cache"}
        if reset_connector:
            cmd["reset_connector"] = True
        return bool(self.request(cmd)["ok"])

    def decode_latency(self, decode_prompt: Sequence[int],
                       traffic_prompt: Sequence[int] | None = None, *, warm_tokens: int = 8,
                       quiet_tokens: int = 32, max_decode_tokens: int = 1024,
                       until_counter: Mapping[str, Any] | None = None,
                       tokens_after_traffic: int | None = None,
                       timeout_s: float = 180.0) -> dict[str, Any]:
        """Inter-token times of ``decode_prompt`` while ``traffic_prompt`` (if any) is
        served beside it, until the state ``decode_latency`` documents (``until_counter``:
        ``{"name", "labels", "at_least"}``, a vLLM counter's growth); the reply as a dict."""
        return self.request({
            "op": "decode_latency", "decode_prompt": list(map(int, decode_prompt)),
            "traffic_prompt": None if traffic_prompt is None else list(map(int, traffic_prompt)),
            "warm_tokens": warm_tokens, "quiet_tokens": quiet_tokens,
            "max_decode_tokens": max_decode_tokens,
            "until_counter": None if until_counter is None else dict(until_counter),
            "tokens_after_traffic": tokens_after_traffic,
            "timeout_s": timeout_s,
        }, timeout_s + 30.0)

    def rss(self) -> dict[str, Any]:
        """Current and peak RSS (MiB) of the driver and its children."""
        return self.request({"op": "rss"})["rss"]

    def close(self, grace_s: float | None = None) -> dict[str, Any] | None:
        """Ask the driver to exit; kill its process group after ``grace_s``
        (default: the driver's shutdown timeout + 30 s).

        Returns the exit reply (``ok``, ``rss``, ``shutdown_s``,
        ``removed_shm``) or None if the driver had to be killed.
        """
        return super().close(self.shutdown_timeout_s + 30.0 if grace_s is None else grace_s)

    def _leftover_glob(self, exited_cleanly: bool) -> str | None:
        # A driver that exits cleanly removes its files itself (``removed_shm``).
        if exited_cleanly or not self.engine_id:
            return None
        return f"/dev/shm/vllm_offload_{glob.escape(self.engine_id)}*.mmap"


def metric_samples(
    metrics: Sequence[Mapping[str, Any]], name: str, **labels: str
) -> list[Mapping[str, Any]]:
    """Samples named ``name`` whose labels include ``labels``."""
    return [
        m for m in metrics
        if m["name"] == name and all(m["labels"].get(k) == v for k, v in labels.items())
    ]


def metric_value(metrics: Sequence[Mapping[str, Any]], name: str, **labels: str) -> float:
    """Sum of the matching counter/gauge values (histograms: their counts)."""
    return float(sum(
        m.get("value", m.get("count", 0)) for m in metric_samples(metrics, name, **labels)
    ))


def close_all(engines: Sequence[EngineDriverProcess]) -> None:
    """Close several engines side by side (each takes seconds to shut down)."""
    threads = [threading.Thread(target=e.close, daemon=True) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def start_all(starters: Sequence[Callable[[], EngineDriverProcess]]) -> list[EngineDriverProcess]:
    """Start several engines side by side (their imports and start-ups overlap); if one
    fails, the others are closed and the first error is raised."""
    results: list[EngineDriverProcess | BaseException | None] = [None] * len(starters)

    def run(i: int) -> None:
        try:
            results[i] = starters[i]()
        except BaseException as exc:  # re-raised below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(starters))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [r for r in results if isinstance(r, EngineDriverProcess)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        close_all(started)
        raise errors[0]
    return started
