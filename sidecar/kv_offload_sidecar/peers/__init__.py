"""Other pods: discovery, authenticated handshakes, links with back-off, and where chunks are."""
