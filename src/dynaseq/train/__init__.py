"""Training: the loop (``dynaseq.train.loop``), checkpoints, schedule, losses (with CCT
in-place self-distillation, ``dynaseq.techniques.cct.self_distill``) and DDP set-up.

Import from the submodules (``from dynaseq.train.loop import train``); this package
imports nothing eagerly so inference code can use checkpoints without the loop.
"""
