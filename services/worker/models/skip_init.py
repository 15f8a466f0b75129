"""Module constructors without their weight initialisation, for models whose every weight is
assigned (a checkpoint) or initialised (random_init) right after they are built on the meta
device.

Skipping it is not only saving work: on the meta device torch runs `nn.init`'s in-place
functions through its Python references, and the first such call imports torch._dynamo,
~1.3 s of a worker's start-up (more while its sibling services start beside it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn import init

#: nn.init's in-place initialisers: what torch's own layers call from reset_parameters.
INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


#: Held while the initialisers are replaced: a second build in another thread waits, rather
#: than saving the replacements as the originals and restoring them for good.
_REPLACING = threading.RLock()


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def init_skipped() -> Iterator[None]:
    """Within: nn.init's initialisers return their tensor untouched. Process-wide while it
    lasts, so only for building a model; builds in other threads wait for it."""
    with _REPLACING:
        saved = {name: getattr(init, name) for name in INIT_FUNCTIONS}
        for name in INIT_FUNCTIONS:
            setattr(init, name, _unchanged)
        try:
            yield
        finally:
            for name, function in saved.items():
                setattr(init, name, function)
