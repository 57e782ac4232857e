"""A pool's reconciliation: its spec read and defaulted, the objects written for it, its status.

``pool_spec`` reads a ``KVOffloadPool``; ``pool_source`` finds the vLLM command line it
translates (``kv_transfer`` adds the tier's ``--kv-transfer-config`` where asked);
``reconcile`` writes ``pool_objects`` (ConfigMap, Secret, Service) and the status;
``pool_key`` and ``key_rotation`` keep the pool Secret; ``model_config`` and
``model_config_follower`` read and follow the model's config.json and the workload;
``ready_peers`` counts the sidecars that report a connected peer; ``pool_api`` reads a
pool and patches its status for them. ``pool_pod`` reads a pool's pod (its vLLM container,
the names injection gives its sidecar) for this package and for the webhook, which builds
on this package and is never imported by it.
"""
