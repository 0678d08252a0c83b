"""Test kits and deliberate cheats: used by the demo and the tests, never by the roles.

`dishonest`: an inference peer that cheats on purpose (the demo's cheater).
`broadcast_peer`: a broadcast-only peer process for the broadcast fault tests and benchmark.
"""
