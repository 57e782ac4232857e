"""The drivers' side of the JSON-lines protocol (standard library only).

``engine_driver`` and ``manager_driver`` run in vLLM's venv and answer their
client (``json_lines_process``) with one JSON line per command on stdout.
vLLM's logger, its engine-core process, C extensions and stray prints must
never write there, so a driver takes the real stdout for the protocol before
it imports vLLM, and from then on fd 1 and ``sys.stdout`` go to stderr (the
client's log file).

``manager_driver`` runs as a script with its own folder off ``sys.path`` and
loads this file by path, so it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ProtocolStdout"]


class ProtocolStdout:
    """The process's real stdout, kept for protocol lines.

    Creating one takes fd 1 over: a private copy of it becomes the protocol
    stream, and fd 1 and ``sys.stdout`` point at stderr.

    Args:
        json_default: ``json.dumps``'s ``default`` for values JSON has no type
            for (``str`` writes them as text; None makes them an error).
    """

    def __init__(self, json_default: Callable[[Any], Any] | None = None) -> None:
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._stream = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
        self._json_default = json_default

    def reply(self, obj: Mapping[str, Any]) -> None:
        """Write ``obj`` as one JSON line and flush it."""
        self._stream.write(json.dumps(obj, default=self._json_default) + "\n")
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()
