"""The cluster's DNS domain, from the pod's resolver configuration, for the pool's Service name.

The operator names the pool's headless Service ``<service>.<namespace>.svc`` (``--peers-dns``),
without the cluster domain: clusters are not all ``cluster.local``. Kubernetes writes the
domain into every pod's ``/etc/resolv.conf`` search list (``<namespace>.svc.<domain>
svc.<domain> <domain>``); ``qualify`` appends it, so the name is resolved and logged fully
qualified. Without such a search entry (not in a pod, another resolver) the name is kept as
given, and the system resolver applies whatever search list it has.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

RESOLV_CONF = "/etc/resolv.conf"


def cluster_domain(resolv_conf: str = RESOLV_CONF) -> str | None:
    """The domain after ``svc.`` in the first search entry that starts so, or None."""
    try:
        with open(resolv_conf, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields and fields[0] in ("search", "domain"):
            for entry in fields[1:]:
                entry = entry.rstrip(".")
                if entry.startswith("svc.") and len(entry) > 4:
                    return entry[4:]
    return None


def qualify(name: str, resolv_conf: str = RESOLV_CONF) -> str:
    """``name`` with the cluster domain appended when it ends in ``.svc``; else ``name``."""
    if not name.endswith(".svc"):
        return name
    domain = cluster_domain(resolv_conf)
    if domain is None:
        log.info("no svc.<domain> search entry in %s: resolving %r with the resolver's search list",
                 resolv_conf, name)
        return name
    return f"{name}.{domain}"
