"""What the doctor reports: the first non-finite value, the op that made it, where and when."""

from __future__ import annotations

import dataclasses

#: The module name of an op outside every module of the model (the loss, an output gradient).
OUTSIDE = "<outside model>"


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first non-finite value the doctor saw: which op made it, where and when."""

    op: str  # the aten op (``addmm``, ``mm``, ``_to_copy``, ``mul`` ...)
    module: str  # qualified module name ("" is the model itself)
    phase: str  # "forward" or "backward"
    dtype: str  # the dtype of the op's output
    step: int  # 0-based index of the model's forward calls since arming
    input_absmax: float  # max |x| over the op's floating inputs
    output_absmax: float  # inf or nan
    weights: str = "step"  # the weights the op ran with: "step" (that step's), or "current"
    # (a replay with the weights at the time of reading, see ampkit.doctor's keep_weights)
    verdict: str = ""  # "handled" (the scaler skipped it and backed off), "harmful", or ""
    # (not judged: first_nonfinite() does not read a scaler; see ampkit.doctor.findings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
