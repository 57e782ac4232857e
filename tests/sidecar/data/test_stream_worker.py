"""A connection's thread hashes each received piece beside its receive where a second core
is usable, in order, and never after ``stop()`` returned; transfers that finish on the threads
before the loop runs share one wake-up of it (``data.tcp.stream_worker``)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from kv_offload_sidecar.data.tcp.stream_worker import LoopWakes, StreamStopped, StreamWorker
from kv_offload_sidecar.store.checksum import chunk_checksum, chunk_hasher

PIECE = 256 << 10

# Receives 8 pieces through a StreamWorker in a process pinned to the cores given as argv[1]
# and prints which threads hashed them, and whether the digest is the data's.
_RECEIVE_IN_PIECES = """
import asyncio, json, os, socket, sys, threading
os.sched_setaffinity(0, json.loads(sys.argv[1]))
from kv_offload_sidecar.data.tcp.stream_worker import StreamWorker
from kv_offload_sidecar.store.checksum import chunk_checksum, chunk_hasher

async def main():
    a, b = socket.socketpair()
    b.setblocking(False)
    data = os.urandom(8 * %(piece)d)
    sender = threading.Thread(target=a.sendall, args=(data,))
    sender.start()
    hasher, threads = chunk_hasher(), []
    def on_piece(piece):
        threads.append(threading.current_thread().name)
        hasher.update(piece)
    dest = bytearray(len(data))
    worker = StreamWorker(b, "kv-offload-test-stream")
    with memoryview(dest) as mv:
        await worker.run(lambda: worker.receive(mv, %(piece)d, 0, on_piece))
    sender.join()
    worker.stop()
    print(json.dumps({"threads": sorted(set(threads)), "pieces": len(threads),
                      "digest_ok": hasher.intdigest() == chunk_checksum(data), "same": dest == data}))

asyncio.run(main())
""" % {"piece": PIECE}


def _send_until_stopped(sock: socket.socket, data: bytes) -> None:
    """``sendall``, ending quietly when the receiving side was shut down first."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def _receive_pinned(cores: set[int]) -> dict:
    done = subprocess.run([sys.executable, "-c", _RECEIVE_IN_PIECES, json.dumps(sorted(cores))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_pieces_are_hashed_on_the_receiving_thread_with_one_core_and_beside_it_with_two() -> None:
    cores = sorted(os.sched_getaffinity(0))
    one = _receive_pinned({cores[0]})
    assert one["same"] and one["digest_ok"] and one["pieces"] > 1
    assert one["threads"] == [t for t in one["threads"] if "-hash" not in t]
    two = _receive_pinned(set(cores[:2]))  # a host with one core fails here: the feature needs two
    assert two["same"] and two["digest_ok"] and two["pieces"] > 1
    # every piece but the last, which the receive waits for anyway, on the hashing thread
    assert any(t.startswith("kv-offload-test-stream-hash") for t in two["threads"])


@pytest.mark.parametrize("pieces", [8, 1], ids=["beside-the-receive", "on-the-receiving-thread"])
async def test_no_piece_is_hashed_after_stop_returns_and_the_receive_says_it_stopped(pieces: int) -> None:
    # The first of 8 pieces is hashed on the hashing thread; a chunk of one piece (its last)
    # on the receiving thread: stop() waits for either.
    a, b = socket.socketpair()
    b.setblocking(False)
    data = os.urandom(pieces * PIECE)
    sender = threading.Thread(target=_send_until_stopped, args=(a, data))
    sender.start()
    gate, started, hashing, hashed_on = threading.Event(), threading.Event(), [], []

    def on_piece(piece: memoryview) -> None:
        hashing.append("start")
        hashed_on.append(threading.current_thread().name)
        started.set()
        gate.wait(60)
        hashing.append("end")

    worker = StreamWorker(b, "kv-offload-test-stream")
    dest = bytearray(len(data))
    try:
        with memoryview(dest) as mv:
            receiving = asyncio.ensure_future(worker.run(lambda: worker.receive(mv, PIECE, 0, on_piece)))
            assert await asyncio.to_thread(started.wait, 60)
            seen_at_return: list[str] = []

            def stop_and_look() -> None:
                worker.stop()
                seen_at_return.extend(hashing)

            stopping = threading.Thread(target=stop_and_look)
            stopping.start()
            # While the piece is held, stop() must not return (a stop() that did not wait
            # returns in microseconds; the correct one never does before the gate opens).
            await asyncio.to_thread(stopping.join, 0.5)
            assert stopping.is_alive() and worker.stopped and seen_at_return == []
            gate.set()
            await asyncio.to_thread(stopping.join, 60)
            assert not stopping.is_alive()
            if pieces > 1:  # the pieces after the first were never hashed
                with pytest.raises(StreamStopped):
                    await receiving
            else:  # its one piece was received and hashed whole before the stop took effect
                await receiving
        # stop() returned only once the piece under way was hashed, and no other was after it.
        assert seen_at_return == hashing == ["start", "end"]
        assert hashed_on[0].startswith("kv-offload-test-stream-hash") == (pieces > 1)
    finally:
        gate.set()
        a.close()
        sender.join(60)
        b.close()


async def test_the_pieces_a_receive_hands_over_digest_to_the_whole_chunk() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    data = os.urandom(3 * PIECE + 7)
    sender = threading.Thread(target=a.sendall, args=(data,))
    sender.start()
    worker = StreamWorker(b, "kv-offload-test-stream")
    dest = bytearray(len(data))
    hasher = chunk_hasher()
    try:
        with memoryview(dest) as mv:
            await worker.run(lambda: worker.receive(mv, PIECE, 0, hasher.update))
        assert dest == data and hasher.intdigest() == chunk_checksum(data)
    finally:
        worker.stop()
        sender.join(60)
        a.close()
        b.close()


async def test_transfers_finished_before_the_loop_runs_share_one_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    woken: list[object] = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        woken.append(callback)
        return real(callback, *args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    wakes = LoopWakes(loop)
    done = [loop.create_future() for _ in range(3)]
    failed, cancelled = loop.create_future(), loop.create_future()
    cancelled.cancel()  # its task gave up: skipped

    def finish() -> None:
        for i, fut in enumerate(done):
            wakes.post(fut, i, None)
        wakes.post(failed, None, ConnectionError("gone"))
        wakes.post(cancelled, 9, None)

    thread = threading.Thread(target=finish)
    thread.start()
    thread.join()  # all of them finished while the loop did not run
    assert await asyncio.gather(*done) == [0, 1, 2]
    with pytest.raises(ConnectionError, match="gone"):
        await failed
    assert len(woken) == 1
    wakes.post(done[0], 0, None)  # a finished future is left alone, the next batch wakes again
    await asyncio.sleep(0)
    assert len(woken) == 2
