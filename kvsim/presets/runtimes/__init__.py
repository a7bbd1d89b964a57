"""Preset data files (TOML), loaded by kvsim.sim.presets."""
