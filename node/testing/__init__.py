"""Test kits and deliberate cheats: used by the demo and the tests, never by the roles.

`dishonest`: an inference peer that cheats on purpose (the demo's cheater).
`attacks`: honest batches and the forgeries the verifier must reject (tests, benchmarks).
`flood`: a sybil flood on a trainer's verification, fresh keys over replaced carriers.
`broadcast_peer`: a broadcast-only peer process for the broadcast fault tests and benchmark.
"""
