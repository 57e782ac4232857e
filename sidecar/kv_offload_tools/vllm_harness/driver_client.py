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
``/dev/shm/vllm_offload_<engine_id>*.mmap`` file a killed engine leaves.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EngineDriverError", "EngineDriverProcess", "close_all", "metric_value",
           "metric_samples", "start_all"]

# .../sidecar (the directory holding the kv_offload_tools package)
_SIDECAR_DIR = str(Path(__file__).resolve().parents[2])


class EngineDriverError(RuntimeError):
    """The driver failed to start, died, timed out or answered with an error."""


class EngineDriverProcess:
    """One engine_driver subprocess.

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

        self._own_stderr = stderr_path is None
        if stderr_path is None:
            fd, stderr_path = tempfile.mkstemp(prefix="engine_driver_", suffix=".log")
            os.close(fd)
        self.stderr_path: str = stderr_path
        self._stderr_file = open(stderr_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr_file, env=full_env, start_new_session=True,
            text=True, bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self._closed = False
        self.engine_id: str | None = None
        try:
            self.ready: dict[str, Any] = self._read_reply(ready_timeout_s, "engine start")
            if not self.ready.get("ready"):
                tb = self.ready.get("traceback")
                raise EngineDriverError(
                    f"engine failed to start: {self.ready.get('error')}\n"
                    + (f"--- driver traceback ---\n{tb}" if tb else "")
                    + f"--- stderr tail ({self.stderr_path}) ---\n{self.stderr_tail()}"
                )
        except BaseException:
            self._own_stderr = False  # keep the log for the post-mortem
            self.close(grace_s=5.0)
            raise
        self.engine_id = self.ready.get("engine_id")
        self.ready_s: float = time.monotonic() - self.started_at

    # -- plumbing -------------------------------------------------------
    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, max_lines: int = 40) -> str:
        """Last lines of the driver's stderr (vLLM's logs)."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError as exc:
            return f"<cannot read {self.stderr_path}: {exc}>"
        return "\n".join(lines[-max_lines:])

    def _read_reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineDriverError(
                f"{what}: no reply within {timeout_s:.0f} s\n"
                f"--- stderr tail ({self.stderr_path}) ---\n{self.stderr_tail()}"
            ) from None
        if line is None:
            self._lines.put(None)  # keep reporting EOF
            rc = self.proc.wait(timeout=10)
            raise EngineDriverError(
                f"{what}: driver exited (rc={rc})\n"
                f"--- stderr tail ({self.stderr_path}) ---\n{self.stderr_tail()}"
            )
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise EngineDriverError(f"{what}: non-protocol line on stdout: {line!r}") from None

    def request(self, cmd: Mapping[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """Send one command and return its reply; raise on an error reply."""
        if self._closed or self.proc.poll() is not None:
            raise EngineDriverError("driver is not running")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(cmd)) + "\n")
        self.proc.stdin.flush()
        reply = self._read_reply(timeout_s, f"op {cmd.get('op')!r}")
        if "error" in reply:
            raise EngineDriverError(
                f"op {cmd.get('op')!r} failed: {reply['error']}\n{reply.get('traceback', '')}"
            )
        return reply

    # -- operations -----------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16,
        ignore_eos: bool = True, timeout_s: float = 120.0,
    ) -> list[dict[str, Any]]:
        """Greedy generation; per prompt ``{"token_ids", "num_cached_tokens", "finish_reason"}``."""
        reply = self.request(
            {"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
             "max_tokens": max_tokens, "ignore_eos": ignore_eos},
            timeout_s,
        )
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

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's own prefix cache (offload tiers keep their data)."""
        return bool(self.request({"op": "reset_prefix_cache"})["ok"])

    def rss(self) -> dict[str, Any]:
        """Current and peak RSS (MiB) of the driver and its children."""
        return self.request({"op": "rss"})["rss"]

    def close(self, grace_s: float | None = None) -> dict[str, Any] | None:
        """Ask the driver to exit; kill its process group after ``grace_s``
        (default: the driver's shutdown timeout + 30 s).

        Returns the exit reply (``ok``, ``rss``, ``shutdown_s``,
        ``removed_shm``) or None if the driver had to be killed.
        """
        if self._closed:
            return getattr(self, "exit_reply", None)
        self._closed = True
        result: dict[str, Any] | None = None
        if grace_s is None:
            grace_s = self.shutdown_timeout_s + 30.0
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
                result = self._read_reply(grace_s, "exit")
            except (OSError, EngineDriverError):
                result = None
            try:
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result = None
        self._kill_group()
        if result is None and self.engine_id:
            for path in glob.glob(f"/dev/shm/vllm_offload_{glob.escape(self.engine_id)}*.mmap"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self._stderr_file.close()
        if self._own_stderr and result is not None and result.get("ok"):
            try:
                os.unlink(self.stderr_path)
            except OSError:
                pass
        self.exit_reply = result
        return result

    def _kill_group(self) -> None:
        """SIGKILL whatever is left of the driver's session (engine core included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> EngineDriverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
