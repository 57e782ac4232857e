"""What runs inside the vLLM process: the secondary tier, its sidecar client, and, in
``contract/``, what the operator shares with them (vLLM's config structs, the model identity,
the ports).

Standard library and numpy only, and nothing outside this subpackage but the
package root: ``kv-offload install-tier`` copies exactly this subpackage (its
subpackages included) into a volume the vLLM container puts on ``PYTHONPATH``.
The operator imports ``engine.contract`` and nothing else of it.
"""
