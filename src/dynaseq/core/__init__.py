"""The floor every other package stands on: errors, typed configs <-> YAML, the run directory
(atomic checkpoints with checksums, the one-trainer lock) and device / process-group set-up.

Imports nothing else from dynaseq.
"""
