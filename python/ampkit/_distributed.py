"""One inf flag for all ranks: what the scaler needs from torch.distributed.

Every rank must skip the same steps and keep the same scale, or the replicas part for
good. Whether the ranks already agree depends on how the gradients are laid out:

- DDP: gradients are all-reduced before the scaler reads them, so every rank sees the
  same inf/NaN: nothing to do.
- FSDP2 (``fully_shard``) and other DTensor gradients: torch's unscaling check on a
  DTensor reduces its flag over the mesh itself. The read-only check of the fused path
  cannot go through DTensor: its inf-norm raises on an empty local shard (a parameter
  whose first dimension is smaller than the world size, such as a ``Linear(d, 1)`` head,
  leaves some ranks an empty shard), and a rank that raises while the others enter the
  next collective hangs them all. So that check reads each rank's local shard
  (:func:`local_shards`, empty ones dropped) and all-reduces its flag over the mesh
  (:func:`reduce_over`): one collective of one float a device, on every rank alike.
- FSDP1 (``FullyShardedDataParallel``): each rank holds a plain local shard of the
  gradients, so an overflow in rank 1's shard is invisible to rank 0. The optimizer holds
  the flat parameters (``use_orig_params=False``) or views of them, the original
  parameters (``use_orig_params=True``), and FSDP1 marks both kinds as its own
  (:func:`_is_fsdp1_managed`). An optimizer holding any of them has its flag all-reduced
  (``MAX``) over the process group: one collective of one float, asynchronous, no host
  sync, capturable in a CUDA graph with NCCL. Every strategy gets it: NO_SHARD's
  gradients are already all-reduced (the collective is then redundant, not wrong), and
  HYBRID_SHARD's are sharded within a replica. A rank that holds no gradient of the
  optimizer (with ``use_orig_params=True`` a parameter can lie wholly in other ranks'
  shards) still takes part, with a 0.0 flag.

:class:`InfFlagSync` decides per optimizer which case applies (auto-detection), or always
reduces over a group the user names. At the first step of a distributed run it also
checks, once, that every rank built its scaler with the same settings, and raises on
every rank when they differ (a rank that backs off on its own would otherwise part
silently).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["InfFlagSync", "local_shards", "reduce_over"]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() else None


def _is_fsdp1_managed(p: torch.Tensor) -> bool:
    """A parameter FSDP1 manages: its gradient may be this rank's shard alone.

    FSDP1 sets ``_fsdp_flattened`` on each FlatParameter and on every original parameter
    it flattens into one (so that nested wrapping never flattens a parameter twice; the
    same attribute from torch 2.4 to 2.13), so it marks what the optimizer holds under
    either ``use_orig_params``. The FlatParameter's own ``_is_flat_param`` marks only the
    first kind. FSDP2's DTensor parameters and DDP's carry no such mark.
    """
    return bool(getattr(p, "_fsdp_flattened", False))


def _group_name(group: Any) -> str:
    return "the default group" if group is None else f"process group {group!r}"


def local_shards(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
    """(each tensor's local part, the process groups of the DTensors' meshes).

    Plain tensors pass through; a DTensor gives its local shard and its mesh's groups
    (one per mesh dimension, deduplicated). Empty shards are kept: the caller decides.
    """
    local, groups = [], []
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        if mesh is None or not hasattr(t, "to_local"):
            local.append(t)
            continue
        local.append(t.to_local())
        for group in mesh.get_all_groups():
            if not any(group is g for g in groups):
                groups.append(group)
    return local, groups


def reduce_over(flags: Sequence[torch.Tensor], groups: Sequence[Any]) -> None:
    """All-reduce (MAX) each flag in place over each group: no host sync, capturable."""
    dist = _dist()
    for group in groups:
        works = [dist.all_reduce(f, op=dist.ReduceOp.MAX, group=group, async_op=True) for f in flags]
        for work in works:
            work.wait()  # on CUDA: the stream waits, the host does not


class InfFlagSync:
    """Combines one scaler's per-device inf flags over the ranks that share the model.

    Args:
        process_group: ``None`` (auto: reduce over the default group only for optimizers
            holding FSDP1-managed parameters, whose gradients are local shards), or a
            ``ProcessGroup`` to reduce over whatever the gradients are (for sharding
            schemes ampkit cannot detect, or an FSDP1 model on another group).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.explicit = process_group is not None
        if self.explicit:
            dist = _dist()
            if dist is None or not dist.is_initialized():
                raise RuntimeError(
                    f"GradScaler(process_group={process_group!r}) needs torch.distributed: "
                    "call torch.distributed.init_process_group(...) before building the "
                    "scaler, or leave process_group=None"
                )
            if process_group is dist.GroupMember.NON_GROUP_MEMBER or (
                isinstance(process_group, dist.ProcessGroup) and dist.get_rank(process_group) < 0
            ):
                raise ValueError(
                    f"process_group does not include this rank (global rank "
                    f"{dist.get_rank()}); pass a group this rank belongs to (on every rank, "
                    "torch.distributed.new_group(ranks=[...]) returns a usable group only to "
                    "its members)"
                )
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(
                    f"process_group must be a torch.distributed.ProcessGroup or None, got "
                    f"{type(process_group).__name__} ({process_group!r:.60})"
                )
        self.group = process_group
        self._reduce_for: dict[int, bool] = {}  # id(optimizer) -> local shards seen
        self.checked = False

    def needed(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when this optimizer's flags must be reduced across ranks."""
        if self.explicit:
            return True
        key = id(optimizer)
        need = self._reduce_for.get(key)
        if need is None:
            # Any one is enough: a model wrapped in part, or an optimizer over FSDP1's
            # parameters and others, has a gradient that one rank alone may see.
            need = any(_is_fsdp1_managed(p) for g in optimizer.param_groups for p in g["params"])
            if need:
                dist = _dist()
                if dist is None or not dist.is_initialized():
                    raise RuntimeError(
                        "this optimizer holds parameters managed by FSDP "
                        "(FullyShardedDataParallel), but torch.distributed is not "
                        "initialized; call torch.distributed.init_process_group(...) first"
                    )
            self._reduce_for[key] = need
        return need

    def combine(self, found_per_device: dict[torch.device, torch.Tensor], device: torch.device) -> None:
        """Set every per-device flag in place to 1.0 on every rank if any rank had a 1.0.

        One collective whatever devices a rank's gradients are on (CPU offload puts them
        elsewhere than the scale): the flags' max on ``device`` (the scale's) is
        all-reduced (MAX) and copied back to the others. A lone flag on ``device``, the
        usual case, is reduced as it is: no kernel, no sync. A rank with no flag (none of
        the optimizer's gradients lies here) adds a 0.0 one on ``device`` to
        ``found_per_device``, so that every rank makes the same collective.
        """
        flags = list(found_per_device.values())
        if not flags:
            flags = [found_per_device.setdefault(device, torch.zeros((), device=device))]
        total = None
        for flag in flags:
            flag = flag if flag.device == device else flag.to(device)
            total = flag if total is None else torch.maximum(total, flag)
        reduce_over([total], [self.group])
        for flag in flags:
            if flag is not total:
                flag.copy_(total)

    def check_settings(self, settings: Sequence[Any], device: str) -> None:
        """Once, at the first step of a distributed run: the same settings on every rank.

        One host-side all-gather (the only one this class ever makes). Every rank receives
        every rank's settings, so all raise together instead of hanging or parting.
        """
        if self.checked:
            return
        dist = _dist()
        if dist is None or not dist.is_initialized() or dist.get_world_size(self.group) < 2:
            self.checked = True
            return
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (device, tuple(settings)), group=self.group)
        self.checked = True
        mine = everyone[dist.get_rank(self.group)]
        differing = [r for r, s in enumerate(everyone) if s != mine]
        if differing:
            lines = "; ".join(f"rank {r}: {s[1]!r} on {s[0]}" for r, s in enumerate(everyone))
            raise RuntimeError(
                f"the GradScaler settings differ across the ranks of {_group_name(self.group)} "
                f"(enabled, init/current scale, growth_factor, backoff_factor, "
                f"growth_interval, hysteresis, min_scale, max_scale): {lines}. Build the "
                "scaler with the same arguments (and load the same state) on every rank."
            )
