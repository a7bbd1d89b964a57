"""Decoding options beyond the papers' protocol (plain greedy decoding), shared by ``kvsim
live`` and minivox's evaluation: the read window on the aligning layers (:mod:`.read_window`),
the ban on short loops (:mod:`.cycle_ban`) and the held end of answer (:mod:`.hold_end`)."""

#: the decoding options' names: ``LiveConfig`` fields, ``run.json`` config fields and run
#: columns (written only when an option is on; absent is plain greedy decoding)
OPTION_KEYS = ("read_window", "ban_cycles", "hold_end")
