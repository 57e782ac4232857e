"""The admission webhook and its certificates: what a labelled pod gets to join its pool.

``admission`` admits or refuses a pod; ``pod_patch`` builds its JSON patch (``pod_host``:
what the pod shares with its node); ``tls_server`` serves the webhook over HTTPS with a
certificate that follows the files on disk; ``certificate`` makes and checks the
self-managed serving certificate the chart's hook Jobs write (``kv-offload webhook-cert``).
It builds on ``pools`` (a pool's spec, objects and pods), which never imports it.
"""
