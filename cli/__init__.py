"""The `swarm-node` command line."""
