"""Which torch.utils.checkpoint forward is running now, and the refusal that uses it.

torch's checkpoint recomputes the forward during backward, outside every ``with`` block,
restoring only torch's own autocast state. A region whose policy changes an op must
therefore not see a plain torch checkpoint begin inside it: the recomputed values would
differ. A region remembers the checkpoint it was entered in (:func:`checkpoint_token`);
each changed op compares it with the current one (:func:`refuse_plain_checkpoint`).
``ampkit.checkpoint`` (ampkit._replayed_regions) replays the policy and is the fix the
error names.
"""

from __future__ import annotations

import inspect
import sys

import torch

_is_compiling = torch.compiler.is_compiling
_REENTRANT_FORWARD = getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None)
_REENTRANT_CODE = getattr(_REENTRANT_FORWARD, "__code__", None)
_CHECKPOINT_CODE = getattr(inspect.unwrap(torch.utils.checkpoint.checkpoint), "__code__", None)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch >= 2.5


def checkpoint_token():
    """An identity of the innermost torch.utils.checkpoint forward running now, or None.

    Non-reentrant: its saved-tensor pack hook (a new function per checkpoint call);
    reentrant (forward without grad): the frame of CheckpointFunction.forward; torch 2.4
    (no hooks query): the frame of checkpoint() itself."""
    if _is_compiling():
        return None
    if _TOP_HOOKS is None:
        return _frame_on_stack((_CHECKPOINT_CODE, _REENTRANT_CODE))
    hooks = _TOP_HOOKS(False)
    if hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", ""):
        return hooks[0]
    return None if torch.is_grad_enabled() else _frame_on_stack((_REENTRANT_CODE,))


def _frame_on_stack(codes):
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in codes:
            return f
        f = f.f_back
    return None


def refuse_plain_checkpoint(op, entered_in):
    """Raise if a torch checkpoint began inside the region that changes ``op``: its
    recomputation would run outside that region. A region entered inside the checkpointed
    function (``entered_in`` is the current checkpoint) is re-entered when it recomputes."""
    current = checkpoint_token()
    if current is not None and current is not entered_in:
        raise RuntimeError(
            f"ampkit autocast: the active policy handles {op!r} differently from torch's autocast, and "
            "torch.utils.checkpoint recomputes the forward outside ampkit's region (it restores only torch's "
            "own autocast state), so the recomputed values would differ. Use ampkit.checkpoint(function, "
            "*args, use_reentrant=..., ...) in place of torch.utils.checkpoint.checkpoint: it takes the same "
            "arguments and replays the region's policy in the recomputation (or enter the region inside "
            "the checkpointed function)."
        )
