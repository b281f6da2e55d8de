"""ampkit: automatic mixed precision for PyTorch that you can read, change and trace.

The whole public API is listed here, one name per line.

>>> import torch, ampkit
>>> with ampkit.autocast("cpu", dtype=torch.bfloat16):
...     y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
>>> y.dtype
torch.bfloat16
"""

from ampkit._rules import CATEGORIES
from ampkit._rules import DeviceRules
from ampkit._policy import Policy
from ampkit._policy import PolicyError
from ampkit._policy import load_policy
from ampkit._autocast import autocast
from ampkit import _compiled_graphs
from ampkit._replayed_regions import checkpoint
from ampkit._replayed_regions import custom_bwd
from ampkit._replayed_regions import custom_fwd
from ampkit._autocast import get_autocast_dtype
from ampkit._autocast import is_autocast_available
from ampkit._autocast import is_autocast_cache_enabled
from ampkit._autocast import is_autocast_enabled
from ampkit._user_ops import op
from ampkit._trace import CastRecord
from ampkit._trace import CastTrace
from ampkit._trace import trace
from ampkit._scaler import GradScaler
from ampkit._scaler import OptState
from ampkit._scaler import ScalerStats
from ampkit._scaler import cuda_amp_grad_scaler
from ampkit._train_step import TrainStep
from ampkit._train_step import make_train_step
from ampkit._doctor import Finding
from ampkit._doctor import doctor
from ampkit._module_policy import ModuleScope
from ampkit._module_scopes import ModuleScopes
from ampkit._fp8_calibrate import Fp8Calibration
from ampkit._fp8_calibrate import Fp8Decision
from ampkit._fp8_calibrate import calibrate_fp8

__version__ = "0.1.0"

_compiled_graphs.install()  # compiled graphs traced under a handler run without it (its docstring)

__all__ = [
    "CATEGORIES",
    "CastRecord",
    "CastTrace",
    "DeviceRules",
    "Finding",
    "Fp8Calibration",
    "Fp8Decision",
    "GradScaler",
    "ModuleScope",
    "ModuleScopes",
    "OptState",
    "Policy",
    "PolicyError",
    "ScalerStats",
    "TrainStep",
    "autocast",
    "calibrate_fp8",
    "checkpoint",
    "cuda_amp_grad_scaler",
    "custom_bwd",
    "custom_fwd",
    "doctor",
    "get_autocast_dtype",
    "is_autocast_available",
    "is_autocast_cache_enabled",
    "is_autocast_enabled",
    "load_policy",
    "make_train_step",
    "op",
    "trace",
]
