"""Handshake logic: pool key loading, hello validation, fail-closed comparison, proofs, replay."""

from __future__ import annotations

import pytest
from kv_offload_sidecar.peers.handshake import (
    HandshakeError,
    HandshakeInitiator,
    HandshakeResponder,
    HelloMessage,
    compare_hello,
    derive_session,
    load_pool_key,
    make_hello,
)
from kv_offload_tools.local_pool import example_config

KEY = b"pool-secret-key-0123456789"


def hello_for(config=None, **changes) -> HelloMessage:
    cfg = config or example_config()
    fields = dict(fingerprint=cfg.fingerprint, hash_seed="0", kv_bytes_per_chunk=cfg.kv_bytes_per_chunk,
                  identity="a", control_address="127.0.0.1:5710", data_address="tcp://127.0.0.1:5810",
                  transport="tcp", run_config=cfg.run_config())
    fields.update(changes)
    return make_hello(**fields)


def full_handshake(client_key: bytes, server_key: bytes, client_hello: HelloMessage,
                   server_hello_fn=lambda: hello_for(identity="b")):
    responder = HandshakeResponder(server_key, server_hello_fn)
    initiator = HandshakeInitiator(client_key, client_hello)
    _, reply = responder.hello(initiator.step1())
    _, step2, out_session = initiator.check_reply(reply)
    in_session = responder.proof(step2)
    return responder, step2, in_session, out_session


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
    _, _, inbound, outbound = full_handshake(KEY, KEY, hello_for())
    assert inbound.session_id == outbound.session_id
    assert inbound.session_key == outbound.session_key
    assert inbound.peer.identity == "a" and outbound.peer.identity == "b"
    assert KEY not in inbound.session_key and len(inbound.session_id) == 16


def test_session_key_depends_on_both_nonces():
    a = derive_session(KEY, b"\1" * 16, b"\2" * 16)
    b = derive_session(KEY, b"\1" * 16, b"\3" * 16)
    assert a[0] != b[0] and a[1] != b[1]


def test_pool_key_never_appears_in_messages():
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    initiator = HandshakeInitiator(KEY, hello_for())
    _, reply = responder.hello(initiator.step1())
    _, step2, _ = initiator.check_reply(reply)
    wire = repr(initiator.step1()) + repr(reply) + repr(step2)
    assert KEY.decode() not in wire and KEY.hex() not in wire


@pytest.mark.parametrize("changes, reason", [
    ({"fingerprint": "0123456789abcdef"}, "fingerprint_mismatch"),
    ({"fingerprint": ""}, "fingerprint_mismatch"),
    ({"hash_seed": "42"}, "hash_seed_mismatch"),
    ({"kv_bytes_per_chunk": 12345}, "chunk_size_mismatch"),
])
def test_server_rejects_differing_peer_with_reason(changes, reason):
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    initiator = HandshakeInitiator(KEY, hello_for(**changes))
    with pytest.raises(HandshakeError) as exc:
        responder.hello(initiator.step1())
    assert exc.value.reason == reason
    assert exc.value.diff


def test_missing_fingerprint_is_a_mismatch_not_accepted():
    body = {"step": "hello", "hello": hello_for().to_dict()}
    del body["hello"]["fingerprint"]
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.hello(body)
    assert exc.value.reason == "fingerprint_mismatch"


def test_empty_local_fingerprint_rejects_everyone():
    assert compare_hello(hello_for(fingerprint=""), hello_for(fingerprint=""))[0] == "fingerprint_mismatch"


def test_wire_major_mismatch_is_rejected_minor_is_not():
    local = hello_for()
    other_major = HelloMessage(**{**local.to_dict(), "wire_version": "2.0"})
    other_minor = HelloMessage(**{**local.to_dict(), "wire_version": "1.7"})
    assert compare_hello(local, other_major)[0] == "wire_version_mismatch"
    assert compare_hello(local, other_minor) is None


def test_fingerprint_rejection_quotes_the_field_diff():
    other = example_config(tokens_per_hash=32, blocks_per_chunk=2)
    verdict = compare_hello(hello_for(), hello_for(other))
    assert verdict is not None
    reason, diff = verdict
    assert reason == "fingerprint_mismatch"
    assert "tokens_per_hash: 16 != 32" in diff
    assert "blocks_per_file: 4 != 2" in diff


def test_rejection_message_names_fields_but_not_the_seed_value():
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b", hash_seed="s3cr3t-seed"))
    with pytest.raises(HandshakeError) as exc:
        responder.hello(HandshakeInitiator(KEY, hello_for(hash_seed="other")).step1())
    assert "hash_seed" in str(exc.value)
    assert "s3cr3t-seed" not in str(exc.value) and "s3cr3t-seed" not in " ".join(exc.value.diff)


def test_wrong_pool_key_fails_on_both_sides_as_bad_proof():
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    initiator = HandshakeInitiator(b"another-key", hello_for())
    _, reply = responder.hello(initiator.step1())
    with pytest.raises(HandshakeError) as client_side:
        initiator.check_reply(reply)
    assert client_side.value.reason == "bad_proof"
    with pytest.raises(HandshakeError) as server_side:
        responder.proof(client_side.value.step2)
    assert server_side.value.reason == "bad_proof"


def test_replayed_step2_is_rejected():
    responder, step2, _, _ = full_handshake(KEY, KEY, hello_for())
    with pytest.raises(HandshakeError) as exc:
        responder.proof(step2)
    assert exc.value.reason == "replay"


def test_replayed_step1_is_rejected():
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    step1 = HandshakeInitiator(KEY, hello_for()).step1()
    responder.hello(step1)
    with pytest.raises(HandshakeError) as exc:
        responder.hello(step1)
    assert exc.value.reason == "replay"


def test_captured_proof_does_not_open_a_new_handshake():
    # An eavesdropper replays step 1 with a fresh client nonce would need a new proof;
    # reusing the captured proof against a new server nonce fails.
    responder, step2, _, _ = full_handshake(KEY, KEY, hello_for())
    attacker = HandshakeInitiator(b"guess", hello_for())
    _, reply = responder.hello(attacker.step1())
    forged = {**step2, "nonce_client": attacker.hello.nonce, "nonce_server": reply["hello"]["nonce"]}
    with pytest.raises(HandshakeError) as exc:
        responder.proof(forged)
    assert exc.value.reason == "bad_proof"


@pytest.mark.parametrize("body", [
    None, [], "x", {"hello": None}, {"hello": {"identity": "a"}},
    {"hello": {**hello_for().to_dict(), "kv_bytes_per_chunk": "16"}},
    {"hello": {**hello_for().to_dict(), "kv_bytes_per_chunk": True}},
    {"hello": {**hello_for().to_dict(), "nonce": "zz"}},
    {"hello": {**hello_for().to_dict(), "identity": 5}},
    {"hello": {**hello_for().to_dict(), "transport": "carrier-pigeon"}},
    {"hello": {**hello_for().to_dict(), "identity": "x" * 5000}},
])
def test_malformed_hello_is_rejected_as_malformed(body):
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.hello(body)
    assert exc.value.reason == "malformed"


@pytest.mark.parametrize("body", [
    None, {}, {"nonce_client": "00", "nonce_server": "00", "proof": "00"},
    {"nonce_client": "0" * 32, "nonce_server": "0" * 32, "proof": 7},
])
def test_malformed_proof_step_is_rejected(body):
    responder = HandshakeResponder(KEY, lambda: hello_for(identity="b"))
    with pytest.raises(HandshakeError) as exc:
        responder.proof(body)
    assert exc.value.reason in ("malformed", "replay")
