"""kv-offload operator: translation of vLLM deployments, the kopf operator and its webhook.

Importing this package is cheap; kopf is imported only by the operator runtime.
"""
