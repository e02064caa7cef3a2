"""Environments as task sources and rewards: verifiers environments, reasoning-gym tasks, chat prompts."""
