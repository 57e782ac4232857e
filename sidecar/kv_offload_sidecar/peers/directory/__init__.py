"""The chunk directory: which member knows who holds which chunks, spread over the pool.

``location`` is the directory as the sidecar uses it (the scheme and its costs are in its
docstring); ``ownership`` picks each chunk's owner; ``publisher`` is the holder's side
(what owners must hear), ``holders`` the owner's side (who holds the chunks it owns);
``location_wire`` the messages between them. Their endpoints are the control port's
(``control/location_routes``), as the handshake's are: the directory imports nothing of
``control``.
"""
