"""``kvsim study table3``: WnW ablations A1–A3 (WnW §3.8, Table 3): n_voice, prefill selection and triage signal as replay proxies and live WER, beside the paper."""

from kvsim.commands.study._wnw_sweep import sweep_command

COMMAND = sweep_command("table3", __doc__.split(": ", 1)[1])
