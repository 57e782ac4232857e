"""Client for ``manager_driver`` (standard library only; usable from any venv).

Starts ``manager_driver.py`` (as a script, so only ``PYTHONPATH`` decides
which ``kv_offload_sidecar`` it imports) with vLLM's python and a given
environment, waits for its ready line, then calls ops over JSON lines::

    drv = ManagerDriverProcess(
        python="/work/main/.venv-vllm/bin/python",
        spec={"offloading_config": config.to_dict(), "engine_id": "mgr-a",
              "cpu_bytes_to_use": 1 << 20,
              "secondary_tiers": [{"type": "KVOffloadSecondaryTier",
                                   "module_path": "kv_offload_sidecar.engine.vllm_tier",
                                   "host": "127.0.0.1", "port": 5710}]},
        pythonpath=[vllm_sources, tier_dest], extra_env={"PYTHONHASHSEED": "0"})
    drv.wait_ready()
    keys = drv.keys(["a-0", "a-1"])
    drv.store(keys)
    drv.lookup(keys, req_id="r1")
    drv.close()

The driver runs in its own session; ``close`` asks it to shut the manager
down and exit, and after ``grace_s`` kills it and removes the
``/dev/shm/vllm_offload_<engine_id>*`` files a killed manager leaves.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DRIVER_PATH", "ManagerDriverError", "ManagerDriverProcess"]

DRIVER_PATH = str(Path(__file__).resolve().with_name("manager_driver.py"))


class ManagerDriverError(RuntimeError):
    """The driver failed to start, died, timed out or answered with an error."""


class ManagerDriverProcess:
    """One ``manager_driver`` subprocess (one vLLM TieringOffloadingManager).

    Args:
        python: vLLM venv's python executable.
        spec: the driver spec (see ``manager_driver``'s docstring).
        pythonpath: entries put first on PYTHONPATH, in order (vLLM 0.33's
            sources, then the ``install-tier`` destination).
        env: base environment (default: a copy of ``os.environ`` without
            PYTHONPATH/PYTHONHOME).
        extra_env: variables set on top (e.g. ``PYTHONHASHSEED``).
        stderr_path: where the driver's logs go; default a temporary file,
            removed on a clean ``close``.
        wait: wait for the ready line in the constructor (else call
            ``wait_ready``; lets several drivers import vLLM concurrently).
    """

    def __init__(self, *, python: str, spec: Mapping[str, Any],
                 pythonpath: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 extra_env: Mapping[str, str] | None = None, stderr_path: str | None = None,
                 wait: bool = False, ready_timeout_s: float = 120.0) -> None:
        if env is None:
            full_env = {k: v for k, v in os.environ.items()
                        if k not in ("PYTHONPATH", "PYTHONHOME")}
        else:
            full_env = dict(env)
        full_env.update(extra_env or {})
        if pythonpath:
            rest = full_env.get("PYTHONPATH", "")
            full_env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *([rest] if rest else [])])
        full_env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.spec = dict(spec)
        self.engine_id = str(self.spec.get("engine_id", ""))
        self._own_stderr = stderr_path is None
        if stderr_path is None:
            fd, stderr_path = tempfile.mkstemp(prefix="manager_driver_", suffix=".log")
            os.close(fd)
        self.stderr_path = stderr_path
        self._stderr_file = open(stderr_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [python, DRIVER_PATH, "--spec-json", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr_file,
            env=full_env, start_new_session=True, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True,
                                        name=f"manager-driver-{self.proc.pid}")
        self._reader.start()
        self._closed = False
        self.ready: dict[str, Any] | None = None
        self.exit_reply: dict[str, Any] | None = None
        self.exit_code: int | None = None
        if wait:
            self.wait_ready(ready_timeout_s)

    # ---- plumbing ---------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, max_lines: int = 40) -> str:
        """Last lines of the driver's stderr (vLLM's and the tier's logs)."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 32768))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError as exc:
            return f"<cannot read {self.stderr_path}: {exc}>"
        return "\n".join(lines[-max_lines:])

    def _read_reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise ManagerDriverError(f"{what}: no reply within {timeout_s:.0f} s\n--- stderr tail "
                                     f"({self.stderr_path}) ---\n{self.stderr_tail()}") from None
        if line is None:
            self._lines.put(None)
            rc = self.proc.wait(timeout=10)
            raise ManagerDriverError(f"{what}: driver exited (rc={rc})\n--- stderr tail "
                                     f"({self.stderr_path}) ---\n{self.stderr_tail()}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ManagerDriverError(f"{what}: non-protocol line on stdout: {line!r}") from None

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait for the ready line; raise with the driver's traceback if it failed."""
        if self.ready is not None:
            return self.ready
        try:
            ready = self._read_reply(timeout_s, "driver start")
            if not ready.get("ready"):
                raise ManagerDriverError(
                    f"manager driver failed to start: {ready.get('error')}\n"
                    f"{ready.get('traceback', '')}--- stderr tail ---\n{self.stderr_tail()}")
        except BaseException:
            self._own_stderr = False
            self.close(grace_s=5.0)
            raise
        self.ready = ready
        self.ready_s = time.monotonic() - self.started_at
        return ready

    def call(self, op: str, reply_timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one op with ``args``; return its reply; raise ManagerDriverError on an
        error reply, a driver that died, or no reply within ``reply_timeout_s``."""
        if self.ready is None:
            self.wait_ready()
        if self._closed or self.proc.poll() is not None:
            raise ManagerDriverError(f"driver is not running (rc={self.proc.poll()})\n"
                                     f"{self.stderr_tail()}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read_reply(reply_timeout_s, f"op {op!r}")
        if not reply.get("ok"):
            raise ManagerDriverError(f"op {op!r} failed: {reply.get('error')}\n"
                                     f"{reply.get('traceback', '')}\n--- stderr tail ---\n"
                                     f"{self.stderr_tail()}")
        return reply

    # ---- ops --------------------------------------------------------------------

    def keys(self, names: Sequence[str], group: int = 0) -> list[str]:
        """vLLM OffloadKeys (hex) of sha256(name) block hashes."""
        return self.call("keys", 60, names=list(names), group=group)["keys"]

    def store(self, keys: Sequence[str], req_id: str | None = None, timeout_s: float = 10.0,
              finish: bool = True) -> dict[str, Any]:
        return self.call("store", timeout_s + 30, keys=list(keys), req_id=req_id,
                         finish=finish, timeout_s=timeout_s)

    def lookup(self, keys: Sequence[str], req_id: str, max_s: float = 10.0,
               stop_at: str | None = None, resume: bool = False) -> dict[str, Any]:
        return self.call("lookup", max_s + 30, keys=list(keys), req_id=req_id, max_s=max_s,
                        stop_at=stop_at, resume=resume)

    def end_step(self, new_req_ids: Sequence[str] = ()) -> dict[str, Any]:
        return self.call("end_step", 60, new_req_ids=list(new_req_ids))

    def load(self, keys: Sequence[str], req_id: str) -> dict[str, Any]:
        return self.call("load", 60, keys=list(keys), req_id=req_id)

    def finish(self, req_id: str) -> dict[str, Any]:
        return self.call("finish", 60, req_id=req_id)

    def reset_cache(self, flush: bool = True, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.call("reset_cache", timeout_s, flush=flush)

    def stats(self) -> dict[str, Any]:
        return self.call("stats", 60)

    def take_events(self) -> list[dict[str, Any]]:
        return self.call("take_events", 60)["events"]

    def tier_state(self) -> dict[str, Any]:
        return self.call("tier_state", 60)

    def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """manager.shutdown() and the driver's checks of vLLM's primary region."""
        return self.call("shutdown", timeout_s)

    # ---- lifecycle --------------------------------------------------------------

    def close(self, grace_s: float = 30.0) -> dict[str, Any] | None:
        """Ask the driver to exit (it shuts its manager down first unless ``shutdown``
        ran); kill its session after ``grace_s``. Returns the exit reply, or None
        if the driver had to be killed. ``exit_code`` holds its exit status."""
        if self._closed:
            return self.exit_reply
        self._closed = True
        result: dict[str, Any] | None = None
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None and self.ready is not None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
                result = self._read_reply(grace_s, "exit")
            except (OSError, ManagerDriverError):
                result = None
        try:
            self.exit_code = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            result = None
        if self.proc.poll() is None or result is None:
            self._kill_group()
        if self.exit_code is None:
            self.exit_code = self.proc.poll()
        if self.engine_id:
            for path in glob.glob(f"/dev/shm/vllm_offload_{glob.escape(self.engine_id)}.mmap*"):
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
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "ManagerDriverProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
