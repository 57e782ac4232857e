"""The TCP data plane: asyncio over non-blocking sockets, zero-copy both ways when plain.

Server (``server``): one task per connection reads request frames; one writer task per
connection sends replies in order with ``sendmsg([header, prefix, slot view])``
(the pinned slot is passed to the kernel as is, never copied in Python).
Client (``client``): one reader task per connection receives every reply; chunk bytes go
with ``loop.sock_recv_into`` straight into the reserved slot, then are committed with
the sender's checksum. Several chunks are requested ahead (the fetch window) so
the socket never idles between chunks. ``sockets`` holds the socket primitives both use.

Under TLS (an ``ssl`` context from ``data.tls``) both sides use ``tls_stream`` instead of the
socket tricks (they would see ciphertext): asyncio's SSL transport, chunk bytes decrypted
straight into the slot, the pinned slot encrypted in pieces without a Python copy.

Address: ``tcp://host:port``, ``tls://host:port`` under TLS.
"""
