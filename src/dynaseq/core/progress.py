"""Progress bars for long commands: tqdm on standard error, shown only on a terminal.

Every command that can run for more than a few seconds (translate, evaluate, calibrate,
analyze, training, the LM workflows) draws one; ``enabled=False`` (``--quiet``) or a standard
error that is not a terminal (a pipe, a log file, CI) shows nothing.

Example::

    with progress_bar(len(lines), "sent", "translate") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int | None, unit: str, desc: str, enabled: bool = True) -> tqdm:
    """A bar of ``total`` ``unit``s (done, rate, ETA) on stderr; off when not ``enabled`` and
    when stderr is not a terminal (tqdm's ``disable=None``)."""
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=None if enabled else True)
