"""Training: the loop (``dynaseq.train.loop``), checkpoints, schedule, loss and DDP set-up.

Import from the submodules (``from dynaseq.train.loop import train``); this package
imports nothing eagerly so inference code can use checkpoints without the loop.
"""
