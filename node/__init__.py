"""Everything that runs: transport host, roles, sampler, trainer, broadcaster, config."""
