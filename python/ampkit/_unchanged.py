"""Whether what the eager train step found out between calls still holds: tensors' metadata
(``SameMeta``, one C++ pass), dicts' contents (``dict_versions``) and, for a captured step,
a batch's shapes, dtypes and devices (``SameSignature``).

The eager train step keeps what it found out about the model's buffers and the optimizer's
parameters between calls, and must notice when one of them changes in place: its ``.data``
replaced by a tensor of another dtype, shape or device (``model.half()`` on a module, say),
a gradient that turns sparse. Reading ``dtype``, ``shape``, ``device`` and ``layout`` from
Python costs about a thousand CPU instructions per attribute per tensor, on every call;
torch.compile's guards make the same check in C++ (``TensorGuards``: class, dispatch keys
and so layout and device type, dtype, device index, requires_grad, sizes and strides). It
checks more than the step needs, never less: a change it reports that did not matter makes
the step find out again what it already knew, nothing worse. Where torch has no such guard
(or cannot build one for these tensors: a sparse one has no strides) the same attributes are
read and compared from Python.

>>> import torch
>>> from ampkit._unchanged import SameMeta
>>> a, b = torch.zeros(3), torch.zeros(2, 2)
>>> same = SameMeta([a, b])
>>> same([a, b])
True
>>> b.data = torch.zeros(4)            # same tensor, another shape
>>> same([a, b])
False

A dict's version (CPython's ``ma_version_tag``, read by torch.compile's guards) changes
whenever the dict does (an item added, removed, or set to another object) and is never
given to two dicts; ``None`` where this torch or Python has none that behaves so (then
callers compare the dicts' contents). ``dict_version`` is the same for one dict (None
likewise), for callers that map it over dicts themselves:

>>> from ampkit._unchanged import dict_versions
>>> d = {"a": 1}
>>> before = dict_versions([d])
>>> d["a"] = object()
>>> dict_versions is None or dict_versions([d]) != before
True
"""

from __future__ import annotations

import operator

import torch

try:  # (torch.compile's guards: torch 2.1 and later)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a build of torch without dynamo
    _TensorGuards = None
try:
    from torch._C._dynamo.guards import dict_version as _dict_version
except ImportError:  # pragma: no cover
    _dict_version = None

__all__ = ["SameMeta", "SameSignature", "dict_version", "dict_versions", "signature"]

_META = operator.attrgetter("dtype", "shape", "device", "layout", "requires_grad")
_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")


class SameMeta:
    """Called with a list of tensors (the same number, in the same order as given here):
    whether each still has the class, dtype, shape, device and layout it had.
    ``in_cpp=False`` compares them from Python, as where torch has no guards (the tests
    run both)."""

    __slots__ = ("_check", "_metas")

    def __init__(self, tensors, in_cpp=True):
        tensors = list(tensors)
        self._check = None
        if in_cpp and _TensorGuards is not None:
            try:
                guards = _TensorGuards(*tensors,
                                       dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                       dynamic_dims_strides=[list(t.stride()) for t in tensors])
                if guards.check(*tensors):  # (a guard that cannot say True is of no use)
                    self._check = guards.check
            except Exception:  # noqa: BLE001 - a signature of another torch, a sparse tensor
                pass
        self._metas = None if self._check is not None else _metas(tensors)

    def __call__(self, tensors) -> bool:
        if self._check is not None:
            return self._check(*tensors)
        return _metas(tensors) == self._metas


def signature(tensors) -> tuple:
    """The shape, dtype and device of each tensor, as a tuple of tuples (compared with ``==``)."""
    return tuple(map(_SHAPE_DTYPE_DEVICE, tensors))


class SameSignature:
    """A batch's ``signature``, kept, and a quick check that another batch has it.

    ``quick(tensors)`` is True only where the tensors have this signature (one ``SameMeta``
    pass, which reads no Python attribute; ``in_cpp`` as for ``SameMeta``); False where they
    may not: ``SameMeta`` compares
    strides and requires_grad too, so a caller that must know compares ``signature(tensors)``
    with ``.signature`` (which reads every attribute from Python, a thousand instructions
    or so each).

    >>> import torch
    >>> batch = [torch.zeros(4, 3), torch.zeros(4)]
    >>> kept = SameSignature(batch)
    >>> kept.quick([torch.ones(4, 3), torch.ones(4)])
    True
    >>> other = [torch.zeros(3, 4).t(), torch.zeros(4)]   # the same shape, other strides
    >>> kept.quick(other), signature(other) == kept.signature
    (False, True)
    """

    __slots__ = ("signature", "_check", "_same", "_count")

    def __init__(self, tensors, in_cpp=True):
        tensors = list(tensors)
        self.signature = signature(tensors)
        self._same, self._count = SameMeta(tensors, in_cpp=in_cpp), len(tensors)
        self._check = self._same._check  # (C++, called here: one Python frame a check)

    def quick(self, tensors) -> bool:
        if len(tensors) != self._count:
            return False
        return self._check(*tensors) if self._check is not None else self._same(tensors)


def _metas(tensors):
    return list(map(type, tensors)), list(map(_META, tensors))


def _versions_behave(version):
    """Whether ``version`` changes with every change to a dict and differs between dicts
    (on a Python whose dicts have no version tag, torch's may return a constant or raise)."""
    try:
        d = {}
        seen = [version(d)]
        d["k"] = object()
        seen.append(version(d))
        d["k"] = object()
        seen.append(version(d))
        d.setdefault("j", 1)
        seen.append(version(d))
        del d["k"]
        seen.append(version(d))
        seen.append(version({}))
        return len(set(seen)) == len(seen) and version(d) == seen[-2]
    except Exception:  # noqa: BLE001 - no usable version: compare contents instead
        return False


def _versions(dicts):
    return list(map(_dict_version, dicts))


_BEHAVE = _dict_version is not None and _versions_behave(_dict_version)
dict_version = _dict_version if _BEHAVE else None  # (one dict's: in a map, without a Python frame)
dict_versions = _versions if _BEHAVE else None
