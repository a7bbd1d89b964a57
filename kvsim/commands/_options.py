"""Help texts shared by the commands that load a real model (trace, calibrate)."""

MODEL_HELP = "voxtral-mini, voxtral-small, qwen-omni, minivox, or a checkpoint directory."
