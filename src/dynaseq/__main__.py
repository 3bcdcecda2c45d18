"""``python -m dynaseq`` (also what ``torchrun -m dynaseq`` runs)."""

import sys

from dynaseq.cli import main

sys.exit(main())
