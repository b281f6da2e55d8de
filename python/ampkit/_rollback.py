"""What the eager train step keeps so that a call that raises changes nothing.

An eager step writes in place in three stages, and keeps what each would need put back:

    forward          writes the model's buffers (BatchNorm statistics)
                     -> ModelBuffers.save(): one foreach copy into kept tensors
    backward         makes fresh gradients (the step starts from none)
                     -> nothing: the old ``.grad`` references are put back
    optimizer step   writes parameters and optimizer state, then scaler.update()
                     -> why_copy() is None: nothing there can raise, so nothing is
                        copied; HeldSignals holds a Ctrl-C until the step is whole
                     -> else: OptimizerCopy, put back if the step raises

The host work of each call is kept near what the hand-written loop does: the buffer list
and the verdict of ``why_copy`` are found once and kept, with a key (dict versions,
identities, lengths and classes: lists compared in C) and a check of the dtypes, shapes,
devices and layouts of the tensors whose metadata they read (``SameMeta``: one C++ pass)
that fail whenever what they were found from changes; then each call costs one
comparison, one check and, for the buffers, one foreach copy. (The verdict on the param
groups' hyperparameters is kept apart, against the groups' versions alone, so that an LR
scheduler's float lr, written every step, finds only it again.)

>>> import torch
>>> from ampkit._rollback import ModelBuffers
>>> bn = torch.nn.BatchNorm1d(3)
>>> kept = ModelBuffers(bn)
>>> kept.save()
>>> _ = bn(torch.randn(4, 3))          # the forward writes the running statistics
>>> kept.restore()                     # ... a later stage raised: put them back
>>> bool((bn.running_mean == 0).all()), int(bn.num_batches_tracked)
(True, 0)
"""

from __future__ import annotations

import copy
import functools
import operator
import signal
import _thread
import threading
import weakref
from itertools import chain

import torch
import torch.optim.optimizer as _optim_module

try:
    import _signal
except ImportError:  # (not CPython)
    _signal = signal

from ampkit._unchanged import SameMeta, dict_version
from ampkit._scaler import GradScaler

__all__ = ["HeldSignals", "KeptCopies", "ModelBuffers", "OptimizerCopy", "PLAIN", "ParkedGrad", "park_grads",
           "unparked",
           "plain_value", "why_copy", "zero_grads_the_graph_had"]

PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors with a foreach copy (KeptCopies)
_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_NONE = type(None)
_PARAMS = operator.itemgetter("params")
_DEREF = weakref.ref.__call__


_is_not_none = functools.partial(operator.is_not, None)
_is = operator.is_
_MAIN_THREAD = threading.main_thread().ident  # (Python runs signal handlers there only)


class KeptCopies:
    """Copies of tensors made with one ``torch._foreach_copy_``, into buffers kept between
    calls in ``pool`` (a dict the caller keeps) for plain CPU tensors.

    A fresh allocation of a large CPU tensor page-faults on every step (glibc hands large
    blocks back to the system), which made a copy cost about 3x what copying into a kept
    buffer costs; CUDA tensors are cloned each time (the caching allocator reuses the
    block, and a kept copy would add them to the peak memory of the forward pass, where a
    transient copy taken after backward does not). Buffers of tensors not copied this time
    are dropped from the pool by ``finish()``.
    """

    def __init__(self, pool):
        self.old, self.now, self.dst, self.src = pool, {}, [], []

    def of(self, t):
        # (tensor subclasses, such as FSDP2's DTensor parameters, have no foreach copy)
        if type(t) not in PLAIN or t.device.type != "cpu":
            return t.detach().clone()
        kept = self.old.get(id(t))  # (weak reference to the tensor, its buffer)
        if kept is None or kept[0]() is not t or kept[1].shape != t.shape or kept[1].dtype != t.dtype:
            kept = (weakref.ref(t), torch.empty_like(t, memory_format=torch.preserve_format))
        self.now[id(t)] = kept
        self.dst.append(kept[1])
        self.src.append(t.detach())
        return kept[1]

    def finish(self):
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
        self.old.clear()
        self.old.update(self.now)


class ModelBuffers:
    """A model's buffers (BatchNorm statistics: the forward writes them) and a kept copy of
    each, on its device, taken by ``save()`` and put back in place by ``restore()``.

    The modules and buffers are found once. Each ``save()`` checks them against what the
    model holds now with a list compared in C (the identities of every module's children
    and buffers) and ``SameMeta`` (the buffers' class, dtype, shape, device and layout, in
    one C++ pass), which catch a module or
    buffer added, removed or reassigned by any route (``setattr``, ``ModuleList.insert``,
    ``model.half()`` replacing buffers, ``.data =`` changing one in place), and finds
    them again when one differs. The copy is one ``torch._foreach_copy_`` per device and dtype into tensors
    kept from the last call (a clone per buffer cost ~10 us of host time each on CUDA);
    a tensor subclass, which has no foreach copy, is cloned. What was found is held
    until the next ``save()`` finds it changed: a module taken out of the model between
    calls is freed at the start of the next eager call, before its forward.
    """

    def __init__(self, model):
        self.model = model
        self._found = None  # (the ids of every module's children, then of every module's buffers)
        self._dicts = self._tensors = self._empty = []
        self._others = self._other_copies = []
        self._need_no_grad = False

    def _look(self):
        # One C-level walk of the kept modules' dicts, children's then buffers' (the objects
        # they name are kept alive by self, and by the model: no identity is reused while
        # compared; a None, a removed buffer's slot, is named too)
        # (or, where dicts have versions, the version of each non-empty one: one C call a
        # dict; the empty ones, most of a model's, are checked still empty by any())
        if dict_version is not None:
            return [*map(dict_version, self._dicts)]
        return list(map(id, chain.from_iterable(map(dict.values, self._dicts))))

    def _find(self):
        modules = list(self.model.modules())
        dicts = [m._modules for m in modules] + [m._buffers for m in modules]
        if dict_version is not None:
            # (an empty dict is unchanged exactly while it stays empty: a child or buffer
            # added to a leaf, by any route, makes it non-empty)
            self._dicts = [d for d in dicts if d]
            self._empty = [d for d in dicts if not d]
        else:
            self._dicts, self._empty = dicts, []
        self._kept = modules
        buffers = [b for m in modules for b in m._buffers.values() if b is not None]
        self._tensors, self._same = buffers, SameMeta(buffers)
        self._found = self._look()
        # (the buffers themselves, not detached aliases, which would keep the storage they
        # had when found if a buffer's .data were replaced since)
        # One foreach copy per (device, dtype): CUDA's foreach copy takes its fused path
        # only when every source shares one dtype; a BatchNorm's int64 num_batches_tracked
        # beside its float statistics sent all of a convnet's buffers to one memcpy each
        # (60 a step on convnet, measured on an H200).
        groups: dict = {}
        for b in buffers:
            if type(b) in PLAIN:
                groups.setdefault((b.device, b.dtype), []).append(b)
        self._plain = [(group, [torch.empty_like(b, memory_format=torch.preserve_format) for b in group])
                       for group in groups.values()]
        self._others = [b for b in buffers if type(b) not in PLAIN]
        self._need_no_grad = any(b.requires_grad for b in buffers)

    def save(self):
        # (one Python frame: this runs on every eager call, with or without buffers)
        tensors = self._tensors
        found = [*map(dict_version, self._dicts)] if dict_version is not None else self._look()
        if found != self._found or any(self._empty) or tensors and not self._same(tensors):
            self._find()
            tensors = self._tensors
        if not tensors:  # (no buffers: nothing to copy, no grad mode to enter)
            return
        if self._others or self._need_no_grad:
            with torch.no_grad():
                for group, copies in self._plain:
                    torch._foreach_copy_(copies, group)
                self._other_copies = [b.detach().clone() for b in self._others]
        else:  # (no buffer requires grad, which SameMeta checks: the copy records nothing)
            for group, copies in self._plain:
                torch._foreach_copy_(copies, group)

    def restore(self):
        with torch.no_grad():
            for group, copies in self._plain:
                torch._foreach_copy_(group, copies)
            for b, v in zip(self._others, self._other_copies):
                b.copy_(v)


class HeldSignals:
    """Hold SIGINT and SIGTERM (where Python handles them) while the optimizer writes
    without a copy: a Ctrl-C there would stop a step half-way with nothing to put back.
    ``deliver()`` runs the handlers of the signals that came, once the step is whole (the
    call then raises KeyboardInterrupt with the step taken). Only the main thread gets
    Python's signals; elsewhere there is nothing to hold. (``_signal``: the C functions
    behind ``signal``, without its wrappers' conversions to enums, the larger part of the
    cost of holding.)"""

    SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))
    # (class defaults, no __init__: one is made at every eager call; the instance's own
    # values are set only where there is something to hold, or that came)
    saved = ()  # ((signal, handler put back by __exit__), ...)
    came = ()  # ((signal, frame), ...): the signals that came while held

    def _hold(self, signum, frame):
        self.came = (*self.came, (signum, frame))

    def __enter__(self):
        if _get_ident() == _MAIN_THREAD:
            int_handler, term_handler = _getsignal(_SIGINT), _getsignal(_SIGTERM)
            # (Python's default SIGTERM action is the C one, SIG_DFL: not callable, not held)
            if callable(int_handler):
                self.saved = ((_SIGINT, int_handler),)
                _signal.signal(_SIGINT, self._hold)
                if callable(term_handler):
                    # (signal() first runs the handlers of signals pending: one that raises
                    # here leaves nothing of this hold installed)
                    try:
                        _signal.signal(_SIGTERM, self._hold)
                    except BaseException:
                        _signal.signal(_SIGINT, int_handler)
                        raise
                    self.saved = ((_SIGINT, int_handler), (_SIGTERM, term_handler))
            elif callable(term_handler):
                self.saved = ((_SIGTERM, term_handler),)
                _signal.signal(_SIGTERM, self._hold)
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved:
            _signal.signal(s, handler)
        return False

    def deliver(self):
        saved = dict(self.saved)
        for signum, frame in self.came:
            saved[signum](signum, frame)


_SIGINT, _SIGTERM = HeldSignals.SIGNALS
_getsignal, _get_ident = _signal.getsignal, _thread.get_ident


def zero_grads_the_graph_had(params, owned):
    """As zero_grad(set_to_none=False) left them: a parameter that had a gradient in the
    graph and got none in this step is stepped with zeros (fresh ones: the graph's stay
    untouched until the step has succeeded). Returns the parameters' gradients after that
    and their classes (for why_copy: read once). (Every parameter got one, the common case:
    C-level maps, no Python loop.)"""
    grads = [*map(_GRAD, params)]
    types = [*map(type, grads)]
    if _NONE not in types:
        return grads, types
    for i, (p, g, now) in enumerate(zip(params, owned, grads)):
        if g is not None and now is None:
            p.grad = grads[i] = torch.zeros_like(g)
    return grads, [*map(type, grads)]


class OptimizerCopy:
    """A copy of an optimizer's parameters, state and hyperparameters, to put back in place.

    In place: tensors keep their identity (a captured graph and the optimizer's own
    references read them by address); state created after the copy is dropped. CPU copies
    go into buffers kept in ``pool`` between steps (``KeptCopies``).
    """

    def __init__(self, optimizer, pool):
        self.optimizer = optimizer
        copies = KeptCopies(pool)
        with torch.no_grad():
            self.params = [(p, copies.of(p)) for g in optimizer.param_groups for p in g["params"]]
            self.state = {p: {k: (v, copies.of(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                              for k, v in s.items()}
                          for p, s in optimizer.state.items()}
            copies.finish()
        self.groups = [dict(g) for g in optimizer.param_groups]

    def restore(self):
        opt = self.optimizer
        with torch.no_grad():
            for p, v in self.params:
                p.copy_(v)
            for p in [p for p in opt.state if p not in self.state]:
                del opt.state[p]
            for p, saved in self.state.items():
                now = opt.state[p]
                for k in [k for k in now if k not in saved]:
                    del now[k]
                for k, (obj, v) in saved.items():
                    if isinstance(obj, torch.Tensor):
                        obj.copy_(v)
                        now[k] = obj
                    else:
                        now[k] = v
        for g, saved in zip(opt.param_groups, self.groups):
            g.clear()
            g.update(saved)


# The optimizers whose step the eager path checks instead of copying: torch's own, whose
# step raises only on what why_copy checks before it (or on a device or allocation error).
_CHECKED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# The one method a GradScaler subclass may override and keep the check: the gradient
# check, which runs before the optimizer writes anything.
_SCALER_HOOKS = frozenset({"found_inf"})
_scaler_types_checked: dict = {}  # GradScaler subclass -> whether only _SCALER_HOOKS are its own
_SCALARS = frozenset({float, int, bool, str, type(None)})  # hyperparameters plain_value() takes at once


def why_copy(optimizer, scaler, kept=None, params=None, grads=None, types=None):
    """Why the eager step must copy parameters and optimizer state before ``scaler.step``
    (a readable reason), or None when nothing from the optimizer's first write to the end
    of ``scaler.update()`` can raise, so that there is never anything to put back.

    torch's SGD, Adam and AdamW raise inside ``step()`` only on what is checked here: a
    sparse gradient, a tensor or otherwise non-plain hyperparameter (a tensor ``lr`` with
    foreach, say), a differentiable step, state that no longer matches its parameter
    (``model.half()`` after a step, say); each param group and each (device, dtype)
    bucket is stepped in turn, so such a raise can come after an earlier one was written.
    Other code in that window is the scaler's own (after ``found_inf``) and, if any, step
    hooks and wrappers, which may raise anywhere: with them the step copies. Left: errors
    of the device or of an allocation. On CUDA only the fused kernels (``fused=True``)
    write without allocating memory the size of the parameters between their writes
    (foreach and per-tensor steps do: an out-of-memory error can stop them half-way), and
    a first step creates state (allocations again): both copy.

    ``kept``: a dict the caller keeps between calls, where the verdicts on the param
    groups' hyperparameters and on the tensors are kept, each with its key: the versions of
    the group dicts (``dict_versions``: a hyperparameter set or a group replaced or added
    changes them; an LR scheduler's float lr misses only this one), and a key of what the
    tensors' verdict reads (see below), with the tensors whose dtype, shape or device the verdict read (``SameMeta``: one C++
    pass). Each is found again only when its key differs. The checks on the optimizer's
    class, step, hooks and the scaler (a handful of values) run every call.

    ``params``, ``grads``, ``types``: a list of parameters that the caller never changes (a
    train step's), their gradients as it read them just before and the gradients' classes,
    or None: the gradients are then read here. With ``kept``, they are taken as the
    optimizer's exactly while the param groups hold these parameters, in this order
    (checked by identity: a group added, or a parameter put in another's place, makes this
    read the gradients itself).
    """
    why = _optimizer_why_copy(optimizer, scaler)
    if why is not None:
        return why
    if kept is None or dict_version is None:
        return _hyperparameters_why_copy(optimizer)[0] or _tensors_why_copy(optimizer)[0]
    groups = optimizer.param_groups
    single = len(groups) == 1  # (the common case: one version, no list built by a map)
    versions = (dict_version(groups[0]),) if single else [*map(dict_version, groups)]
    if kept.get("groups") != versions:
        why, keep = _hyperparameters_why_copy(optimizer)
        kept["groups"], kept["hyperparameters"] = (versions if keep else None), why
        # (what the tensors' verdict reads of the groups: found again whenever a group changed)
        kept["flags"] = list(map(_group_flags, groups))
    if kept["hyperparameters"] is not None:
        return kept["hyperparameters"]
    # The key of the tensors' verdict: what _tensors_why_copy reads but the metadata of the
    # tensors it names (kept["params_read"], kept["read"]: checked below) and the parameters'
    # identities (kept["params"], compared below), in one flat list compared in C, each
    # part's length fixed by what comes before it: the number of groups, each one's flags
    # (found above whenever a group changed) and number of parameters; each parameter's
    # gradient's class (None too); each gradient's layout; the number of states and the
    # versions of the state's dicts (a state created, replaced or added to changes them).
    # C-level maps, no Python loop over the parameters and no Python frame: this runs on
    # every eager call. (An empty state is unchanged exactly while it stays empty: its
    # length says so, no version.)
    state = optimizer.state
    if single:  # (the group's own list, not a copy)
        found = groups[0]["params"]
        lengths = (len(found),)
    else:
        lists = [*map(_PARAMS, groups)]
        found, lengths = [*chain.from_iterable(lists)], map(len, lists)
    # The parameters found with the verdict are held (a train step holds them anyway), so
    # an identity compared is never one reused by a later object.
    known = kept.get("params")
    same = known is not None and len(known) == len(found) and all(map(_is, found, known))
    if not (same and grads is not None and params is kept["given"]):
        grads, types = [*map(_GRAD, found)], None
    if types is None:
        types = [*map(type, grads)]
    key = [kept["flags"], *lengths, *types,
           *map(_LAYOUT, filter(_is_not_none, grads) if _NONE in types else grads), len(state)]
    if state:
        key += map(dict_version, (state, *state.values()))
    if same and kept.get("key") == key and (kept["same"] is None or kept["same"](
            [*kept["params_read"], *map(_DEREF, kept["read"])])):
        return kept["why"]
    kept.pop("key", None)
    kept["params_read"], kept["params"] = (), None
    why, read = _tensors_why_copy(optimizer, [])
    if read is not None:
        kept["why"] = why
        # The parameters among them are held as they are (no call through a weak reference
        # each), the state weakly (_watch); parameters first.
        named = set(map(id, found))
        params_read = [t for t in read if id(t) in named]
        state_read = [t for t in read if id(t) not in named]
        kept["params_read"] = params_read
        kept["read"] = _watch(state_read, kept)
        kept["same"] = SameMeta(params_read + state_read) if read else None
        kept["params"] = list(found)
        # (the caller's list, whose gradients stand for the optimizer's while the groups
        # hold these parameters: only where it names exactly them)
        kept["given"] = params if params is not None and len(params) == len(found) and all(
            map(_is, found, params)) else None
        kept["key"] = key
    return why


def _optimizer_why_copy(optimizer, scaler):
    # (run every call: plain loads and dict lookups, the reasons' names made only for one)
    kind = type(optimizer)
    if kind not in _CHECKED_OPTIMIZERS:
        return f"{kind.__name__} is not torch's SGD, Adam or AdamW, whose steps can be checked beforehand"
    own = vars(optimizer)  # (torch's own classes: the hooks' dicts are instance attributes)
    step = own.get("step")
    # (an LR scheduler wraps step() on the instance, to note that it was called)
    if step is not None and not (getattr(step, "_wrapped_by_lr_sched", False)
                                 and getattr(step, "__wrapped__", None) is kind.step):
        return f"{kind.__name__}.step is replaced on the instance"
    if (own.get("_optimizer_step_pre_hooks") or own.get("_optimizer_step_post_hooks")
            or _optim_module._global_optimizer_pre_hooks or _optim_module._global_optimizer_post_hooks):
        return f"{kind.__name__} has step hooks"
    # (_scaler_why_copy, its class's verdict looked up here: one Python frame less a call)
    own = vars(scaler)
    if _scaler_types_checked.get(type(scaler)) is not True or "step" in own or "update" in own:
        return _scaler_why_copy(scaler)
    return None


def _hyperparameters_why_copy(optimizer):
    """(why the param groups' hyperparameters need a copy or None, whether that verdict may
    be kept against the groups' versions: not where a value of a mutable type, a list, could
    change in place without changing its group's version)."""
    name, keep = type(optimizer).__name__, True
    for group in optimizer.param_groups:
        for k, v in group.items():
            if type(v) not in _SCALARS and k != "params":
                keep = keep and _immutable(v)
                if not plain_value(v):
                    return f"{name} has a {type(v).__name__} {k!r}", keep
        if group.get("differentiable"):
            return f"{name} was built with differentiable=True", keep
    return None, keep


def _group_flags(group):
    return bool(group.get("fused")), group.get("momentum")


def _immutable(v):
    return type(v) in _SCALARS or isinstance(v, torch.Tensor) or (
        type(v) is tuple and all(map(_immutable, v)))


def _watch(read, kept):
    """Weak references to the state tensors whose metadata the verdict read: when one is
    freed, the key is forgotten. Weak: a state replaced by load_state_dict is freed at once,
    not held through the next call's forward."""
    def forget(_, kept=kept):
        kept.pop("key", None)

    return [weakref.ref(t, forget) for t in read]


def _tensors_why_copy(optimizer, read=None):
    # read: a list to which the tensors whose metadata decided the verdict are added (set
    # to None, returned, where one is a tensor subclass: its local shard is read through an
    # attribute no key follows), or None
    name = type(optimizer).__name__
    state, strided, tensor = optimizer.state, torch.strided, torch.Tensor
    for group in optimizer.param_groups:
        any_device = group.get("fused")
        stateless = type(optimizer) is torch.optim.SGD and not group.get("momentum")  # (no momentum buffer)
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if read is not None and (type(p) not in PLAIN or type(grad) not in PLAIN):
                read = None
            local = _local(p)
            if local is None:
                return f"a parameter is a {type(p).__name__}", read
            grad = _local(grad)
            if grad is None or grad.layout is not strided:
                return f"a gradient is {grad.layout if grad is not None else type(p.grad).__name__}", read
            s = state.get(p)
            if read is not None and (s or not any_device):  # (its dtype, shape or device read below)
                read.append(p)
            if not (any_device or local.is_cpu):
                return (f"{name} without fused=True allocates while it writes on "
                        f"{local.device.type} (an out-of-memory error could stop it half-way)"), read
            if not s:
                if stateless:
                    continue
                return f"{name} creates its state in this step", read
            dtype, device, shape = local.dtype, local.device, local.shape
            for k, v in s.items():
                if not isinstance(v, tensor) or k == "step":
                    continue
                if read is not None:
                    if type(v) in PLAIN:
                        read.append(v)
                    else:
                        read = None
                v = _local(v)
                if v is None:
                    return f"{name}'s state {k!r} is a {type(s[k]).__name__}", read
                if v.dtype is not dtype or v.device != device or v.shape != shape:
                    return (f"{name}'s state {k!r} ({v.dtype}, {v.device}) does not match its "
                            f"parameter ({dtype}, {device})"), read
    return None, read


def _local(t):
    """The tensor the kernels write: a plain tensor itself, a DTensor's (FSDP2's) local
    shard (one fused op over DTensors runs once over the local shards, after the sharding
    is checked for all of them: all or nothing), anything else None."""
    if type(t) in PLAIN:
        return t
    local = getattr(t, "_local_tensor", None)  # (to_local() is an autograd op: ~15 us a call)
    return local if type(local) in PLAIN else None


def _scaler_why_copy(scaler):
    kind = type(scaler)
    known = _scaler_types_checked.get(kind)
    if known is None:
        own = {k for c in kind.__mro__[:kind.__mro__.index(GradScaler)] for k in vars(c)
               if not (k.startswith("__") and k.endswith("__"))}
        known = _scaler_types_checked[kind] = own <= _SCALER_HOOKS
    if not known:
        return f"the scaler's class {kind.__name__} overrides more than found_inf"
    d = vars(scaler)
    if "step" in d or "update" in d:
        return "the scaler's step or update is replaced on the instance"
    return None


def plain_value(v):
    """Whether a hyperparameter is a host value (numbers, strings, None, tuples of them)."""
    if isinstance(v, (tuple, list)):
        return all(plain_value(x) for x in v)
    return isinstance(v, (int, float, bool, str, type(None)))


class ParkedGrad:
    """A gradient that a rollback may need, kept on the host meanwhile.

    A call of a train step keeps the ``.grad`` it found, so that a failure puts it back;
    on the device that copy sits beside the step's own gradients and activations. In the
    calls that run once or a few times (make_train_step's warm-up steps and the call that
    captures) the old gradients are copied to the host instead, once, and their device
    memory goes as soon as the step drops them: the model's size in gradients less at the
    peak of those calls (issue 26: the captured step's peak, which is in its warm-up or its
    capture). A rollback makes a device tensor again from the host copy: the same values,
    dtype, shape and device, a new tensor.
    """

    __slots__ = ("host", "device")

    def __init__(self, grad: torch.Tensor):
        self.host = grad.to("cpu")
        self.device = grad.device

    def back(self) -> torch.Tensor:
        return self.host.to(self.device)


def park_grads(grads: list) -> None:
    """Replace, in ``grads`` (a call's saved ``.grad`` references, in place), each plain CUDA
    tensor that owns its memory by a ``ParkedGrad``. Views (DistributedDataParallel's
    gradients as bucket views) and other tensor types (FSDP2's DTensors) stay as they are:
    parking them would free nothing, or would not put back what they alias."""
    for i, g in enumerate(grads):
        if type(g) in PLAIN and g.device.type == "cuda" and g._base is None and g.layout is torch.strided:
            grads[i] = ParkedGrad(g)


def unparked(grad):
    """``grad``, or the device tensor made again from a ``ParkedGrad``.

    >>> g = torch.ones(2)
    >>> unparked(g) is g, unparked(None) is None
    (True, True)
    """
    return grad.back() if type(grad) is ParkedGrad else grad
