"""Tasks: each owns its data, loss, validation metric and Predictor
(:mod:`~dynaseq.tasks.translation`, :mod:`~dynaseq.tasks.lm`)."""
