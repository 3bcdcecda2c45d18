"""``python -m dynaseq`` (also what ``torchrun -m dynaseq`` runs)."""

from dynaseq.cli import entry

entry()
