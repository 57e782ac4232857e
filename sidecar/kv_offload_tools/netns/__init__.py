"""Pods in network namespaces of their own, joined through a router namespace (tests, ``bench netns``).

- ``ip``: the ``ip``/``tc`` commands, whether namespaces are permitted here, and ``inside`` (this
  thread in a pod's namespace, for an engine or a probe);
- ``network``: ``PodNetwork``, the router and pod namespaces, their addresses and routes, each
  pod's resolver view of the pool name (hosts file and resolv.conf: pods left out, a resolver
  that fails, a cluster domain), and the faults (silent partitions, bandwidth caps);
- ``pool``: ``NetnsPool``, a LocalPool whose sidecars run one per pod namespace and find each
  other by the pool name; pods stop and start again, or another pool's sidecar takes one's
  address;
- ``probes``: what crosses the router (a datagram, a timed transfer) and the TCP connections a
  pod holds (``ss``).
"""
