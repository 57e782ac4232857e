"""Handshake logic: pool key loading, hello validation, fail-closed comparison, proofs, replay."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HandshakeInitiator,
    HandshakeResponder,
    WIRE_VERSION,
    HelloMessage,
    compare_hello,
    derive_session,
    load_pool_key,
)
from kv_offload_sidecar.peers.pool_keys import PoolKeys, hkdf, key_id
from kv_offload_sidecar.peers.wire_window import SPOKEN, WIRE_OLDEST
from kv_offload_sidecar.engine.contract.model_identity import ModelIdentity
from kv_offload_testing.local_pool import example_config
from kv_offload_testing.sidecar_process import STAND_IN_IDENTITY
from sidecar_support import peer_hello

KEY = b"pool-secret-key-0123456789"
# The stand-in engines' identity with other weights (a rollout to retrained weights).
OTHER_WEIGHTS = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": "files:9c1d000000000000"})


def full_handshake(client_key, server_key, client_hello: HelloMessage,
                   server_hello_fn=lambda: peer_hello(identity="b")):
    responder = HandshakeResponder(server_key, server_hello_fn)
    initiator = HandshakeInitiator(client_key, client_hello)
    step2 = initiator.step2(responder.hello(initiator.step1()))
    in_session, accepted = responder.proof(step2)
    _, out_session = initiator.finish(accepted)
    return responder, step2, in_session, out_session


def rejection(responder, initiator) -> HandshakeError:
    """The HandshakeError of a handshake the responder refuses (at either step)."""
    with pytest.raises(HandshakeError) as exc:
        responder.proof(initiator.step2(responder.hello(initiator.step1())))
    return exc.value


def test_load_pool_key_strips_whitespace(tmp_path):
    p = tmp_path / "key"
    p.write_bytes(b"  secret\n")
    assert load_pool_key(str(p)) == b"secret"


def test_load_pool_key_missing_file_names_file_and_fix(tmp_path):
    with pytest.raises(ValueError, match=r"pool key file .*nokey.* does not exist: mount"):
        load_pool_key(str(tmp_path / "nokey"))


def test_load_pool_key_empty_file_is_an_error(tmp_path):
    p = tmp_path / "key"
    p.write_bytes(b"\n \n")
    with pytest.raises(ValueError, match="is empty"):
        load_pool_key(str(p))


def test_directory_as_pool_key_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unreadable"):
        load_pool_key(str(tmp_path))


def test_matching_peers_derive_the_same_session():
    _, _, inbound, outbound = full_handshake(KEY, KEY, peer_hello())
    assert inbound.session_id == outbound.session_id
    assert inbound.session_key == outbound.session_key
    assert inbound.peer.identity == "peer-x" and outbound.peer.identity == "b"
    assert KEY not in inbound.session_key and len(inbound.session_id) == 16
    assert inbound.key_id == outbound.key_id == key_id(KEY)


def test_session_key_is_hkdf_of_the_pool_key_and_both_nonces():
    nc, ns = b"\1" * 16, b"\2" * 16
    sid, skey = derive_session(KEY, nc, ns, key_id(KEY))
    assert skey == hkdf(KEY, nc + ns, b"kv-offload session v2\x00" + key_id(KEY))
    assert derive_session(KEY, nc, b"\3" * 16)[1] != derive_session(KEY, nc, ns)[1]
    assert derive_session(KEY, b"\3" * 16, ns)[0] != sid


def test_hkdf_matches_rfc5869_test_case_1():
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = hkdf(ikm, salt, info, 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_pool_key_and_hash_seed_never_appear_in_messages():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b", hash_seed="31337"))
    initiator = HandshakeInitiator(KEY, peer_hello(hash_seed="31337"))
    step1 = initiator.step1()
    reply1 = responder.hello(step1)
    step2 = initiator.step2(reply1)
    _, reply2 = responder.proof(step2)
    wire = repr(step1) + repr(reply1) + repr(step2) + repr(reply2)
    assert KEY.decode() not in wire and KEY.hex() not in wire
    assert "31337" not in wire


def test_step1_reply_says_nothing_about_the_pool():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    reply = responder.hello(HandshakeInitiator(KEY, peer_hello()).step1())
    assert set(reply) == {"wire_version", "wire_min", "wire_max", "nonce", "key_id"}
    assert (reply["wire_min"], reply["wire_max"]) == (WIRE_OLDEST, WIRE_VERSION)


@pytest.mark.parametrize("changes, reason", [
    ({"fingerprint": "0123456789abcdef"}, "fingerprint_mismatch"),
    ({"fingerprint": ""}, "fingerprint_mismatch"),
    ({"hash_seed": "42"}, "hash_seed_mismatch"),
    ({"kv_bytes_per_chunk": 12345}, "chunk_size_mismatch"),
    ({"model_identity": OTHER_WEIGHTS}, "model_mismatch"),
    ({"model_identity": None}, "model_mismatch"),
])
def test_server_rejects_differing_key_holder_with_reason(changes, reason):
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    exc = rejection(responder, HandshakeInitiator(KEY, peer_hello(**changes)))
    assert exc.reason == reason
    assert exc.diff


def test_client_runs_the_same_comparison_on_the_servers_hello():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    initiator = HandshakeInitiator(KEY, peer_hello())
    _, accepted = responder.proof(initiator.step2(responder.hello(initiator.step1())))
    # a server that accepted but sent another chunk size (a bug or a forgery with the key)
    tampered = {**accepted, "hello": {**accepted["hello"], "kv_bytes_per_chunk": 7}}
    with pytest.raises(HandshakeError) as exc:
        initiator.finish(tampered)
    assert exc.value.reason == "bad_proof"  # the server proof covers its hello


def test_missing_fingerprint_is_a_mismatch_not_accepted():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    initiator = HandshakeInitiator(KEY, peer_hello())
    step2 = initiator.step2(responder.hello(initiator.step1()))
    del step2["hello"]["fingerprint"]
    initiator_hello = HelloMessage.from_dict(step2["hello"])
    from kv_offload_sidecar.peers.handshake import client_proof, transcript
    kid = bytes.fromhex(responder.keys.offered_ids()[0].hex())
    step2["proof"] = client_proof(KEY, transcript(bytes.fromhex(step2["nonce_client"]),
                                                  bytes.fromhex(step2["nonce_server"]), kid, initiator_hello))
    with pytest.raises(HandshakeError) as exc:
        responder.proof(step2)
    assert exc.value.reason == "fingerprint_mismatch"


def test_empty_local_fingerprint_rejects_everyone():
    assert compare_hello(peer_hello(fingerprint=""), peer_hello(fingerprint=""))[0] == "fingerprint_mismatch"


def test_hellos_of_other_wire_versions_differ_minor_included():
    local = peer_hello()
    for version in ("3.0", "2.7"):
        other = HelloMessage(**{**local.to_dict(), "wire_version": version})
        assert compare_hello(local, other) == ("wire_version_mismatch",
                                               [f"wire_version: {WIRE_VERSION} != {version}"])


def test_two_sidecars_of_this_release_agree_on_its_own_wire_version():
    _, step2, in_session, out_session = full_handshake(KEY, KEY, peer_hello())
    assert step2["hello"]["wire_version"] == WIRE_VERSION
    assert in_session.peer.wire_version == out_session.peer.wire_version == WIRE_VERSION


def test_the_previous_release_stating_no_range_is_spoken_to_in_its_version():
    # the release before the window (wire 2.1) sends only "wire_version" in step 1 and ignores
    # the range of the reply
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    previous = HandshakeInitiator(KEY, HelloMessage(**{**peer_hello().to_dict(), "wire_version": WIRE_OLDEST}))
    step1 = previous.step1()
    del step1["wire_min"], step1["wire_max"]
    session, accepted = responder.proof(previous.step2(responder.hello(step1)))
    assert accepted["hello"]["wire_version"] == WIRE_OLDEST == session.peer.wire_version
    # and as a client: a server stating only its "wire_version" gets a hello of that version
    initiator = HandshakeInitiator(KEY, peer_hello())
    reply = {"wire_version": WIRE_OLDEST, "nonce": "11" * 16, "key_id": key_id(KEY).hex()}
    assert initiator.step2(reply)["hello"]["wire_version"] == WIRE_OLDEST


def test_a_release_older_than_the_window_is_refused_naming_both_ranges():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    older = HandshakeInitiator(KEY, HelloMessage(**{**peer_hello().to_dict(), "wire_version": "2.0"}))
    exc = rejection(responder, older)
    assert exc.reason == "wire_version_mismatch"
    assert exc.diff[0] == f"wire_version: speaks {SPOKEN.text} != 2.0..2.0 (no version in common)"


def test_a_range_altered_in_step_1_is_refused_after_the_proof():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    initiator = HandshakeInitiator(KEY, peer_hello())
    reply = {**responder.hello(initiator.step1()), "wire_max": WIRE_OLDEST}  # a downgrade in transit
    with pytest.raises(HandshakeError) as exc:
        responder.proof(initiator.step2(reply))
    assert exc.value.reason == "wire_version_mismatch"
    assert exc.value.diff[0] == (f"wire_version: {WIRE_VERSION} (speaks {SPOKEN.text}) != {WIRE_OLDEST} "
                                 f"(speaks {SPOKEN.text})")


@pytest.mark.parametrize("fields", [{"wire_min": "two"}, {"wire_max": None},
                                    {"wire_min": "2.3", "wire_max": "2.1"}],
                         ids=["min-not-a-version", "max-null", "min-above-max"])
def test_a_malformed_range_in_step_1_is_refused_as_malformed(fields):
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.hello({**HandshakeInitiator(KEY, peer_hello()).step1(), **fields})
    assert exc.value.reason == "malformed" and "wire_m" in str(exc.value)


def test_a_wire_1_step_1_is_malformed_and_names_no_version():
    old = {"step": "hello", "hello": {**peer_hello().to_dict(), "wire_version": "1.0", "nonce": "00" * 16}}
    with pytest.raises(HandshakeError) as exc:
        HandshakeResponder(KEY, lambda: peer_hello(identity="b")).hello(old)
    assert exc.value.reason == "malformed" and exc.value.diff == []
    assert WIRE_VERSION not in str(exc.value)


def test_a_stranger_of_another_wire_version_gets_the_answer_of_any_stranger():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    answers = []
    for version in (WIRE_VERSION, "1.0", "3.0", "99.1"):
        with pytest.raises(HandshakeError) as exc:
            responder.hello({**HandshakeInitiator(b"another-key", peer_hello()).step1(), "wire_version": version})
        answers.append((exc.value.reason, str(exc.value), exc.value.diff))
    assert answers[0][0] == "other_pool"
    assert answers.count(answers[0]) == len(answers)


def test_a_key_holder_of_another_wire_version_learns_the_mismatch_after_its_proof():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    newer = HandshakeInitiator(KEY, HelloMessage(**{**peer_hello().to_dict(), "wire_version": "3.0"}))
    reply = responder.hello({**newer.step1(), "wire_version": "3.0"})
    assert set(reply) == {"wire_version", "wire_min", "wire_max", "nonce", "key_id"}
    with pytest.raises(HandshakeError) as exc:
        responder.proof(newer.step2(reply))
    assert exc.value.reason == "wire_version_mismatch"
    assert exc.value.diff == [f"wire_version: speaks {SPOKEN.text} != 3.0..3.0 (no version in common)"]


def test_a_client_proves_its_key_to_a_server_of_another_wire_version():
    # the server's step-1 answer names another major: the client still sends its proof, so the
    # server (which checks it first) can name the mismatch to a key holder
    initiator = HandshakeInitiator(KEY, peer_hello())
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    reply = {**responder.hello(initiator.step1()), "wire_version": "3.0", "wire_min": "3.0", "wire_max": "3.0"}
    assert initiator.step2(reply)["step"] == "proof"


def test_other_weights_under_the_same_fingerprint_are_rejected_with_the_field_diff():
    verdict = compare_hello(peer_hello(), peer_hello(model_identity=OTHER_WEIGHTS))
    assert verdict is not None
    reason, diff = verdict
    assert reason == "model_mismatch"
    assert diff == [f"weights: {STAND_IN_IDENTITY.weights} != files:9c1d000000000000"]


def test_a_sidecar_without_its_engines_identity_rejects_everyone():
    reason, diff = compare_hello(peer_hello(model_identity=None), peer_hello())
    assert reason == "model_mismatch"
    assert "this sidecar's engine has not attached" in diff[0]
    unknown = ModelIdentity(**{**STAND_IN_IDENTITY.to_dict(), "weights": ""})
    assert compare_hello(peer_hello(model_identity=unknown),
                         peer_hello(model_identity=unknown))[0] == "model_mismatch"


def test_fingerprint_rejection_quotes_the_field_diff():
    other = example_config(tokens_per_hash=32, blocks_per_chunk=2)
    verdict = compare_hello(peer_hello(), peer_hello(other))
    assert verdict is not None
    reason, diff = verdict
    assert reason == "fingerprint_mismatch"
    assert "tokens_per_hash: 16 != 32" in diff
    assert "blocks_per_file: 4 != 2" in diff


def test_rejection_message_names_fields_but_not_the_seed_value():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b", hash_seed="s3cr3t-seed"))
    exc = rejection(responder, HandshakeInitiator(KEY, peer_hello(hash_seed="other")))
    assert exc.reason == "hash_seed_mismatch"
    assert "hash_seed" in str(exc)
    assert "s3cr3t-seed" not in str(exc) and "s3cr3t-seed" not in " ".join(exc.diff)


def test_a_stranger_learns_nothing_about_the_pool_config():
    # no pool key: refused at step 1 before any hello is exchanged, whatever its config
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    answers = []
    for changes in ({}, {"fingerprint": "0123456789abcdef"}, {"kv_bytes_per_chunk": 1}):
        with pytest.raises(HandshakeError) as exc:
            responder.hello(HandshakeInitiator(b"another-key", peer_hello(**changes)).step1())
        answers.append((exc.value.reason, str(exc.value), exc.value.diff))
    assert answers[0][0] == "other_pool" and answers[0][2] == []
    assert answers[0] == answers[1] == answers[2]


def test_a_forged_key_id_still_needs_the_proof():
    # a stranger who copies a member's key id gets a nonce but cannot prove the key
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    stranger = HandshakeInitiator(b"another-key", peer_hello())
    step1 = {**stranger.step1(), "key_ids": [key_id(KEY).hex()]}
    reply = responder.hello(step1)
    forged = {"step": "proof", "nonce_client": step1["nonce"], "nonce_server": reply["nonce"],
              "hello": peer_hello().to_dict(), "proof": "00" * 32}
    with pytest.raises(HandshakeError) as exc:
        responder.proof(forged)
    assert exc.value.reason == "bad_proof" and exc.value.diff == []


def test_either_key_works_while_a_rotation_rolls_out():
    old, new = b"old-pool-key-0123456789", b"new-pool-key-0123456789"
    updated, not_yet = PoolKeys(new, old), PoolKeys(old)
    # updated dials not-yet: they agree on the old key
    _, _, inbound, outbound = full_handshake(updated, not_yet, peer_hello())
    assert inbound.key_id == outbound.key_id == key_id(old)
    # not-yet dials updated: old key again
    _, _, inbound, _ = full_handshake(not_yet, updated, peer_hello())
    assert inbound.key_id == key_id(old)
    # both updated: the new key
    _, _, inbound, _ = full_handshake(PoolKeys(new, old), updated, peer_hello())
    assert inbound.key_id == key_id(new)
    # after the rotation, a pod that only has the new key refuses the old one
    exc_holder = HandshakeResponder(PoolKeys(new), lambda: peer_hello(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        exc_holder.hello(HandshakeInitiator(PoolKeys(old), peer_hello()).step1())
    assert exc.value.reason == "other_pool"


def test_replayed_step2_is_rejected():
    responder, step2, _, _ = full_handshake(KEY, KEY, peer_hello())
    with pytest.raises(HandshakeError) as exc:
        responder.proof(step2)
    assert exc.value.reason == "replay"


def test_replayed_step1_is_rejected():
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    step1 = HandshakeInitiator(KEY, peer_hello()).step1()
    responder.hello(step1)
    with pytest.raises(HandshakeError) as exc:
        responder.hello(step1)
    assert exc.value.reason == "replay"


def test_captured_proof_does_not_open_a_new_handshake():
    # an eavesdropper replays a captured step 2 against a new server nonce: the proof fails
    responder, step2, _, _ = full_handshake(KEY, KEY, peer_hello())
    attacker = HandshakeInitiator(b"guess", peer_hello())
    step1 = {**attacker.step1(), "key_ids": [key_id(KEY).hex()]}
    reply = responder.hello(step1)
    forged = {**step2, "nonce_client": step1["nonce"], "nonce_server": reply["nonce"]}
    with pytest.raises(HandshakeError) as exc:
        responder.proof(forged)
    assert exc.value.reason == "bad_proof"


def _step1(**changes):
    return {**HandshakeInitiator(KEY, peer_hello()).step1(), **changes}


@pytest.mark.parametrize("body", [
    None, [], "x", {"hello": None}, {"hello": {"identity": "a"}},
    _step1(nonce="zz"), _step1(nonce=5), _step1(key_ids=[]), _step1(key_ids="00"),
    _step1(key_ids=["00"]), _step1(key_ids=["00" * 8] * 9), _step1(wire_version="two"),
    _step1(wire_version=None),
])
def test_malformed_step1_is_rejected_as_malformed(body):
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.hello(body)
    assert exc.value.reason == "malformed"


@pytest.mark.parametrize("edit", [
    lambda h: h.update(kv_bytes_per_chunk="16"), lambda h: h.update(kv_bytes_per_chunk=True),
    lambda h: h.update(identity=5), lambda h: h.update(transport="carrier-pigeon"),
    lambda h: h.update(identity="x" * 5000), lambda h: h.pop("data_address"),
    lambda h: h.update(model_identity={"weights": 5}), lambda h: h.update(model_identity=[]),
    lambda h: h.update(model_identity={"tokenizer": "x"}),
])
def test_malformed_hello_in_step2_is_rejected_as_malformed(edit):
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    initiator = HandshakeInitiator(KEY, peer_hello())
    step2 = initiator.step2(responder.hello(initiator.step1()))
    edit(step2["hello"])
    with pytest.raises(HandshakeError) as exc:
        responder.proof(step2)
    assert exc.value.reason == "malformed"


@pytest.mark.parametrize("body", [
    None, {}, {"nonce_client": "00", "nonce_server": "00", "proof": "00"},
    {"nonce_client": "0" * 32, "nonce_server": "0" * 32, "proof": 7},
])
def test_malformed_proof_step_is_rejected(body):
    responder = HandshakeResponder(KEY, lambda: peer_hello(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.proof(body)
    assert exc.value.reason in ("malformed", "replay")
