"""Suite-wide settings (UCX on this CPU-only host, no proxies for loopback) and fixtures."""

import os
import shutil
import tempfile
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
