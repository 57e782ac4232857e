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
down (unless ``shutdown`` ran) and exit, and after ``grace_s`` kills it and
removes the ``/dev/shm/vllm_offload_<engine_id>*`` files a killed manager
leaves (the process plumbing is ``json_lines_process``'s, shared with
``driver_client``).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .json_lines_process import JsonLinesProcess, JsonLinesProcessError

__all__ = ["DRIVER_PATH", "ManagerDriverError", "ManagerDriverProcess"]

DRIVER_PATH = str(Path(__file__).resolve().with_name("manager_driver.py"))


class ManagerDriverError(JsonLinesProcessError):
    """The driver failed to start, died, timed out or answered with an error."""


class ManagerDriverProcess(JsonLinesProcess):
    """One ``manager_driver`` subprocess (one vLLM TieringOffloadingManager).

    Args:
        python: vLLM venv's python executable.
        spec: the driver spec (see ``manager_driver``'s docstring).
        pythonpath: entries put first on PYTHONPATH, in order (a vLLM
            release's sources, then the ``install-tier`` destination).
        env: base environment (default: a copy of ``os.environ`` without
            PYTHONPATH/PYTHONHOME).
        extra_env: variables set on top (e.g. ``PYTHONHASHSEED``).
        stderr_path: where the driver's logs go; default a temporary file,
            removed on a clean ``close``.
        wait: wait for the ready line in the constructor (else call
            ``wait_ready``; lets several drivers import vLLM concurrently).
    """

    error_type = ManagerDriverError

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
        super().__init__([python, DRIVER_PATH, "--spec-json", json.dumps(self.spec)],
                         env=full_env, name="manager_driver", stderr_path=stderr_path)
        if wait:
            self.wait_ready(ready_timeout_s)

    def call(self, op: str, reply_timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one op with ``args``; return its reply; raise ManagerDriverError on an
        error reply, a driver that died, or no reply within ``reply_timeout_s``."""
        return self.request({"op": op, **args}, reply_timeout_s)

    # ---- ops --------------------------------------------------------------------

    def keys(self, names: Sequence[str], group: int = 0) -> list[str]:
        """vLLM OffloadKeys (hex) of sha256(name) block hashes."""
        return self.call("keys", 60, names=list(names), group=group)["keys"]

    def store(self, keys: Sequence[str], req_id: str | None = None, timeout_s: float = 60.0,
              finish: bool = True) -> dict[str, Any]:
        """Store ``keys`` and step until their cascades finished (``timeout_s`` only guards
        against a hang: the reply's ``jobs_left`` says whether any job was still unfinished)."""
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

    def wait_sidecar_instance(self, instance: str, tier: int = 0,
                              timeout_s: float = 60.0) -> dict[str, Any]:
        """Until tier ``tier`` names sidecar ``instance`` (the new one, after a restart),
        looking up a harmless key through the tier so that it notices the restart.

        ``timeout_s`` only guards against a hang; returns the driver's reply
        (``elapsed_s``, ``probes``); raises ManagerDriverError past it."""
        r = self.call("sidecar_instance", timeout_s + 60, tier=tier, wait_for=instance,
                      timeout_s=timeout_s)
        if not r["matched"]:
            raise self._error(f"tier {tier} did not attach to sidecar instance {instance!r} "
                              f"within {timeout_s:.0f} s: {r}")
        return r

    def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """manager.shutdown() and the driver's checks of vLLM's primary region."""
        return self.call("shutdown", timeout_s)

    # ---- lifecycle --------------------------------------------------------------

    def _leftover_glob(self, exited_cleanly: bool) -> str | None:
        # After a clean exit too, in case vLLM's shutdown failed to unlink it.
        if not self.engine_id:
            return None
        return f"/dev/shm/vllm_offload_{glob.escape(self.engine_id)}.mmap*"
