"""A driver subprocess spoken to in JSON lines (standard library only; usable from any venv).

The base of the harness's clients, ``driver_client.EngineDriverProcess`` and
``manager_client.ManagerDriverProcess``: each starts a driver with vLLM's
python, writes one JSON command per line to its stdin and reads one JSON reply
per line from its stdout. The protocol the drivers keep (``driver_protocol``):
the first line is ``{"ready": true, ...}`` or ``{"ready": false, "error",
"traceback"}``; a reply carrying ``"error"`` means the command failed and the
driver is still up; ``{"op": "exit"}`` makes the driver clean up, answer and exit.

The driver runs in its own session, so ``close`` can kill everything it
started (vLLM's engine core included). Its stderr (vLLM's logs) goes to a
file, kept when anything went wrong; every error raised here ends with its tail.
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
from typing import Any, TypeVar

__all__ = ["JsonLinesProcess", "JsonLinesProcessError"]

_P = TypeVar("_P", bound="JsonLinesProcess")

# How much of the end of the stderr log ``stderr_tail`` reads.
_TAIL_BYTES = 32768


class JsonLinesProcessError(RuntimeError):
    """The driver failed to start, died, timed out or answered with an error."""


class JsonLinesProcess:
    """One driver subprocess and its JSON-lines protocol.

    A subclass builds the command line and environment, sets ``error_type``
    to its own exception, and overrides ``_leftover_glob`` when a driver that
    was killed leaves shared memory behind.

    Args:
        cmd: the driver's command line, vLLM's python first.
        env: the driver's whole environment.
        name: the driver's name, used in messages, the log's file name and
            the reader thread's name.
        stderr_path: where the driver's stderr goes; default a temporary file,
            removed by a ``close`` whose exit reply says ``ok``.
    """

    error_type: type[JsonLinesProcessError] = JsonLinesProcessError

    def __init__(self, cmd: Sequence[str], *, env: Mapping[str, str], name: str,
                 stderr_path: str | None = None) -> None:
        self.name = name
        self._own_stderr = stderr_path is None
        if stderr_path is None:
            fd, stderr_path = tempfile.mkstemp(prefix=f"{name}_", suffix=".log")
            os.close(fd)
        self.stderr_path: str = stderr_path
        self._stderr_file = open(stderr_path, "wb")
        self.proc = subprocess.Popen(
            list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr_file, env=dict(env), start_new_session=True,
            text=True, bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True,
                                        name=f"{name}-{self.proc.pid}")
        self._reader.start()
        self._closed = False
        # The ready line, once read and saying ready.
        self.ready: dict[str, Any] | None = None
        # What ``close`` got back: the exit reply (None if the driver was killed)
        # and the driver's exit status.
        self.exit_reply: dict[str, Any] | None = None
        self.exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    # -- reading ----------------------------------------------------------
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
                f.seek(max(0, f.tell() - _TAIL_BYTES))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError as exc:
            return f"<cannot read {self.stderr_path}: {exc}>"
        return "\n".join(lines[-max_lines:])

    def _error(self, message: str, driver_traceback: str | None = None) -> JsonLinesProcessError:
        """``message``, then the driver's traceback if it sent one, then the stderr tail."""
        parts = [message]
        if driver_traceback:
            parts.append(f"--- driver traceback ---\n{driver_traceback.rstrip()}")
        parts.append(f"--- stderr tail ({self.stderr_path}) ---\n{self.stderr_tail()}")
        return self.error_type("\n".join(parts))

    def _read_reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise self._error(f"{what}: no reply within {timeout_s:.0f} s") from None
        if line is None:
            self._lines.put(None)  # keep reporting EOF
            rc = self.proc.wait(timeout=10)
            raise self._error(f"{what}: {self.name} exited (rc={rc})")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise self._error(f"{what}: non-protocol line on stdout: {line!r}") from None

    # -- protocol ---------------------------------------------------------
    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait for the ready line and return it. If the driver failed to start
        (or timed out), close it, keep its log and raise with its traceback."""
        if self.ready is not None:
            return self.ready
        try:
            ready = self._read_reply(timeout_s, f"{self.name} start")
            if not ready.get("ready"):
                raise self._error(f"{self.name} failed to start: {ready.get('error')}",
                                  ready.get("traceback"))
        except BaseException:
            self._own_stderr = False  # keep the log for the post-mortem
            self.close(grace_s=5.0)
            raise
        self.ready = ready
        return ready

    def request(self, cmd: Mapping[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """Send one command and return its reply; raise on an error reply, a
        driver that is not running, or no reply within ``timeout_s``."""
        if self.ready is None and not self._closed:
            self.wait_ready()
        op = cmd.get("op")
        if self._closed or self.proc.poll() is not None:
            raise self._error(f"op {op!r}: {self.name} is not running (rc={self.proc.poll()})")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(cmd)) + "\n")
        self.proc.stdin.flush()
        reply = self._read_reply(timeout_s, f"op {op!r}")
        if "error" in reply:
            raise self._error(f"op {op!r} failed: {reply['error']}", reply.get("traceback"))
        return reply

    # -- lifecycle --------------------------------------------------------
    def close(self, grace_s: float = 30.0) -> dict[str, Any] | None:
        """Ask the driver to exit, then kill its session (whatever is left of it)
        after at most ``grace_s``, and remove the files ``_leftover_glob`` names.

        Returns the exit reply, or None if the driver had to be killed (or never
        got ready). ``exit_code`` holds its exit status; the log is removed only
        when it was a temporary file and the exit reply says ``ok``.
        """
        if self._closed:
            return self.exit_reply
        self._closed = True
        result: dict[str, Any] | None = None
        deadline = time.monotonic() + grace_s
        # Before the ready line is read, the first line read would be that line.
        if self.proc.poll() is None and self.ready is not None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
                result = self._read_reply(grace_s, "exit")
            except (OSError, JsonLinesProcessError):
                result = None
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            result = None
        self._kill_group()
        self.exit_code = self.proc.poll()
        pattern = self._leftover_glob(exited_cleanly=result is not None)
        for path in glob.glob(pattern) if pattern else ():
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

    def _leftover_glob(self, exited_cleanly: bool) -> str | None:
        """Glob of the files ``close`` removes (``exited_cleanly``: the driver
        answered exit and exited in time); None removes nothing."""
        return None

    def _kill_group(self) -> None:
        """SIGKILL whatever is left of the driver's session (vLLM's engine core included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
