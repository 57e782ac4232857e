"""The contract the operator shares with the tier: vLLM's config structs, the model identity, the ports.

Exactly what ``kv_offload_operator`` imports of ``engine/`` (a test holds it to that):
``offloading_config`` (vLLM's OffloadingConfig, its canonical JSON and fingerprint, the
file the operator writes and the sidecar and the tier read), ``model_identity`` (what a
serve line declares and an engine loaded; pods whose identities differ never share) and
``ports`` (vLLM's side-channel variables and the DP port rule: control port ``base + i``).

It is part of ``engine/``: copied into vLLM's volume by ``kv-offload install-tier``,
standard library only, importing nothing outside this subpackage. A change here changes
what the operator writes and what the tier inside a running vLLM reads: both sides of a
rolling upgrade must agree (docs/how-to/upgrade.md).
"""
