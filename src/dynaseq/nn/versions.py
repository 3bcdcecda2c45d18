"""Version counters of the tensors that lean decoders and encoders, packed int8 weights and
cached counts copy from: a holder compares them to know whether its copy is stale.

Why by hand: ``Tensor._version`` raises for an inference tensor (one made under
``torch.inference_mode``, e.g. a model a user loaded inside that mode), which keeps no
counter; nothing in torch answers "the counter, or none".
"""

from __future__ import annotations

from torch import Tensor


def version_of(t: Tensor) -> int | None:
    """``t._version`` (moves at every in-place change, ``load_state_dict`` included), or None
    for an inference tensor, which keeps no counter: whether it changed is unknown, so a
    copy of it is never taken as current (:func:`unchanged`). ``dynaseq.load`` builds its
    models outside inference mode, so theirs always count."""
    return None if t.is_inference() else t._version


def versions_of(tensors: list[Tensor]) -> list[int | None]:
    """:func:`version_of` of each tensor."""
    return [version_of(t) for t in tensors]


def unchanged(tensors: list[Tensor], versions: list[int | None]) -> bool:
    """Whether ``tensors`` are as they were when ``versions`` (:func:`versions_of`) were
    read: False when any version is unknown (an inference tensor)."""
    return None not in versions and versions_of(tensors) == versions
