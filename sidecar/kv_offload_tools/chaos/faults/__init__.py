"""The fault scenarios: ``bench`` (the pool, engines and results they share),
``engine_faults`` (signals, restarts and a write flood under the engines) and
``wire_faults`` (damaged bytes, kills at a byte and reconnect storms, through
``FaultProxy``)."""
