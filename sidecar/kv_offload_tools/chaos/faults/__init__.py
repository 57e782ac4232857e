"""The fault scenarios: ``bench`` (the pool, engines and results they share),
``engine_faults`` (signals, restarts and a write flood under the engines),
``wire_faults`` (damaged bytes, kills at a byte and reconnect storms, through
``FaultProxy``; on nixl, the request connection only), ``slot_faults`` (nixl:
the holder's slot bytes flipped under a one-sided READ) and ``late_writer_row`` (tcp and tls
holders stopped or fetchers' loops blocked past a deadline: no late byte in a slot or row)."""
