"""Suite-wide settings (UCX on this CPU-only host, no proxies for loopback) and fixtures."""

import asyncio
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

# UCX: CPU transports only; loopback device for tests.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    os.environ.pop(var, None)
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A short directory (Unix socket paths are limited) in /dev/shm when possible."""
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="kvo-t-", dir=parent)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Seconds into a test after which the asyncio tasks still pending are printed (before
# pytest-timeout's 300 s ends it, whose dump shows threads only, not coroutines).
TASK_DUMP_AFTER_SECONDS = 270.0


@pytest.fixture(autouse=True)
def _dump_asyncio_tasks_of_a_hung_test() -> Iterator[None]:
    """A test that hangs inside an event loop leaves what every pending task awaits in its
    captured stderr: the state a hang needs to be understood, at no cost otherwise."""
    done = threading.Event()

    def dump() -> None:
        if done.wait(TASK_DUMP_AFTER_SECONDS):
            return
        tasks = [t for t in list(asyncio.tasks._all_tasks) if not t.done()]  # type: ignore[attr-defined]
        print(f"--- {len(tasks)} asyncio tasks pending after {TASK_DUMP_AFTER_SECONDS:.0f} s ---", file=sys.stderr)
        for t in tasks:
            t.print_stack(file=sys.stderr)

    watchdog = threading.Thread(target=dump, name="asyncio-task-dump", daemon=True)
    watchdog.start()
    yield
    done.set()
