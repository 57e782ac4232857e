"""The fault scenarios: ``bench`` (the pool, engines and results they share),
``engine_faults`` (signals, restarts and a write flood under the engines),
``wire_faults`` (damaged bytes, kills at a byte and reconnect storms, through
``FaultProxy``; on nixl, the request connection only) and ``slot_faults`` (nixl:
the holder's slot bytes flipped under a one-sided READ)."""
