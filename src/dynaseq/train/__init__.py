"""Training: the one loop over any :class:`~dynaseq.tasks.protocol.Task`
(:mod:`dynaseq.train.loop`), learning-rate schedules and the loop's counters.

Import from the submodules (``from dynaseq.train.loop import train``); this package imports
nothing eagerly.
"""
