"""Pods in network namespaces of their own, joined through a router namespace (tests, ``bench netns``).

- ``ip``: the ``ip``/``tc`` commands, whether namespaces are permitted here, and ``inside`` (this
  thread in a pod's namespace, for an engine or a probe);
- ``network``: ``PodNetwork``, the router and pod namespaces, their addresses and routes, each
  pod's hosts-file view of the pool name, and the faults (silent partitions, bandwidth caps);
- ``pool``: ``NetnsPool``, a LocalPool whose sidecars run one per pod namespace and find each
  other by the pool name;
- ``probes``: what crosses the router (a datagram, a timed transfer) and the TCP connections a
  pod holds (``ss``).
"""
