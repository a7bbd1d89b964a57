"""``kvsim study table7``: WnW hyperparameter sensitivity (WnW App. C, Table 7): chunk size, anchor count, δ, top-k and stride at r_GPU 0.2 as replay proxies and live WER."""

from kvsim.commands.study._wnw_sweep import sweep_command

COMMAND = sweep_command("table7", __doc__.split(": ", 1)[1])
