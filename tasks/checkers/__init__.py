"""Reward checkers for post-training: plain functions registered by name (the registry comes later); `sandbox` runs
untrusted generated code."""
