"""Generating completions for online RL (issue 31): per-completion seeded sampling and the
rollout engines that run it."""
