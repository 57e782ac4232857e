"""The control plane: one aiohttp app per DP port (health, metrics, handshake, admin) and the
local channel the engine's tier talks to."""
