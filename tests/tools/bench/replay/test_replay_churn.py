"""Peer churn during a replay costs only misses: pods leave, crash, restart and join mid-stream.

Four real sidecar processes replay generated chat conversations (what the
vLLM tier does per request: lookup, load verified byte for byte, store). A
third of the way in, one pod leaves (SIGTERM) and another crashes (SIGKILL)
and comes back under its name with an empty store; a new pod joins. Requests
keep going to the live pods throughout. No wrong byte is ever loaded, no
engine call errors or times out, the pool keeps sharing (peer hits after the
churn, the newcomer among both givers and takers), and the directory settles
on the new membership.
"""

from __future__ import annotations

from kv_offload_sidecar.engine.store_view import slot_stride_for
from kv_offload_tools.bench.replay.cli import request_keys, serve_request, sidecar_config
from kv_offload_testing.local_pool import LocalPool
from kv_offload_tools.workloads import ConversationSpec, conversation

CHUNK = 4096
TIMEOUT = 2.0


def test_pods_leaving_crashing_and_joining_during_a_replay_cost_only_misses():
    stream = request_keys([r.hash_ids for r in conversation(ConversationSpec(sessions=40, turns=4, seed=5))])
    churn_at = len(stream) // 3
    with LocalPool(4, config=sidecar_config(CHUNK), capacity_bytes=400 * slot_stride_for(CHUNK),
                   publish_interval_seconds=0.05, fetch_deadline_seconds=TIMEOUT, log_level="WARNING") as pool:
        clients = {sc.identity: sc.client(timeout=TIMEOUT) for sc in pool.sidecars}
        live = [sc.identity for sc in pool.sidecars]
        mismatched = peer_before = peer_after = 0
        newcomer_gave = newcomer_took = 0
        for r, req in enumerate(stream):
            if r == churn_at:
                clients.pop("sidecar-1").close()
                assert pool["sidecar-1"].terminate() == 0  # leaves
                live.remove("sidecar-1")
                clients.pop("sidecar-2").close()
                pool.restart(2, kill=True)  # crashes, comes back with an empty store
                clients["sidecar-2"] = pool["sidecar-2"].client(timeout=TIMEOUT)
                newcomer = pool.add(identity="newcomer")  # joins the mesh
                clients["newcomer"] = newcomer.client(timeout=TIMEOUT)
                live.append("newcomer")
                sent_before = newcomer.metric("kv_offload_peer_bytes_total", direction="sent")
            pod = live[r % len(live)]
            out = serve_request(clients[pod], req, CHUNK, TIMEOUT)
            assert out.loaded <= out.local + out.peer
            mismatched += out.mismatched
            peer = max(0, out.loaded - out.local)
            if r < churn_at:
                peer_before += peer
            else:
                peer_after += peer
                newcomer_took += peer if pod == "newcomer" else 0
        newcomer_gave = pool["newcomer"].metric("kv_offload_peer_bytes_total", direction="sent") - sent_before
        for pod, client in clients.items():
            assert client.errors == 0 and client.timeouts == 0, pod
            client.close()
        assert mismatched == 0
        assert peer_before > 0 and peer_after > 0
        assert newcomer_took > 0 and newcomer_gave > 0
        pool.wait_directory_current(timeout=10)  # the directory settled on the live members
        assert {s.identity for s in pool.members()} == {"sidecar-0", "sidecar-2", "sidecar-3", "newcomer"}
