"""Live decoding with KV-cache policies applied inside the model's attention (closed loop)."""
