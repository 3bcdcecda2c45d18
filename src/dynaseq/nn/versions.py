"""Versions of the tensors that lean decoders and encoders, packed int8 weights and cached
counts copy from: a holder compares them to know whether its copy is stale.

A version is the tensor's counter of in-place changes (``Tensor._version``) together with
its storage address and dtype (a move to another device is new storage): ``param.data =
...`` (what ``Module.to(dtype)`` and ``.half()`` do) gives a parameter new contents without
moving its counter, and a copy made from the old storage would otherwise still look current.
Not seen: a conversion there and back (``.to(bfloat16).to(float32)``) whose last storage
happens to land at the first one's address; prepare anew after such round trips.

Why by hand: ``Tensor._version`` raises for an inference tensor (one made under
``torch.inference_mode``, e.g. a model a user loaded inside that mode), which keeps no
counter; nothing in torch answers "the counter, or none".
"""

from __future__ import annotations

import torch
from torch import Tensor

Version = tuple[int, int, torch.dtype]
"""``(t._version, t.data_ptr(), t.dtype)``."""


def version_of(t: Tensor) -> Version | None:
    """``t``'s counter of in-place changes (``load_state_dict`` included), storage address
    and dtype; None for an inference tensor, which keeps no counter: whether it
    changed is unknown, so a copy of it is never taken as current (:func:`unchanged`).
    ``dynaseq.load`` builds its models outside inference mode, so theirs always count."""
    return None if t.is_inference() else (t._version, t.data_ptr(), t.dtype)


def versions_of(tensors: list[Tensor]) -> list[Version | None]:
    """:func:`version_of` of each tensor."""
    return [version_of(t) for t in tensors]


def unchanged(tensors: list[Tensor], versions: list[Version | None]) -> bool:
    """Whether ``tensors`` are as they were when ``versions`` (:func:`versions_of`) were
    read: False when any version is unknown (an inference tensor)."""
    return None not in versions and versions_of(tensors) == versions
