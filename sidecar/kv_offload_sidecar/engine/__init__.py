"""What runs inside the vLLM process: the secondary tier, its sidecar client, and vLLM's config structs.

Standard library and numpy only, and nothing outside this subpackage but the
package root: ``kv-offload install-tier`` copies exactly this subpackage into
a volume the vLLM container puts on ``PYTHONPATH``.
"""
