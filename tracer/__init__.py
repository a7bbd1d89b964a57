"""Everything that touches a real model: backbone adapters, audio input, attention capture,
word alignment, calibration (WnW Appendix E)."""
