"""Decoding options beyond the papers' protocol (plain greedy decoding), shared by ``kvsim
live`` and minivox's evaluation: the read window on the aligning layers (:mod:`.read_window`)
and the ban on short loops (:mod:`.cycle_ban`)."""
