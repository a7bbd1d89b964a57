"""Preset data files for the hardware simulator: gpus/, models/, runtimes/ (TOML with sources)."""
