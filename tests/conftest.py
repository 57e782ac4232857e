"""Suite-wide settings: UCX on this CPU-only host, no proxies for loopback."""

import os

# UCX: CPU transports only; loopback device for tests.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    os.environ.pop(var, None)
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
