"""A/B scripts: one kernel or template against another at fixed configs, on one GPU in one call."""
