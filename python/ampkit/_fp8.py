"""The fp8 category: a matmul whose operands are cast to 8-bit floats with a scale.

An op of a policy's ``fp8`` category (``linear``, ``mm``, ``matmul``; written as
``input @ weight.T``) runs through one autograd Function per scaling recipe
(ampkit._fp8_recipe):

    forward   scale_x, scale_w = the recipe's scales (below), in float32
              xq = (x * scale_x).clamp(-max, max).to(forward_dtype)   # max: the fp8 dtype's
              wq = (w * scale_w).clamp(-max, max).to(forward_dtype)
              CUDA, capability >= 8.9, shapes _scaled_mm takes:
                  out = torch._scaled_mm(xq, wq.T, 1/scale_x, 1/scale_w, bias=bias.to(dtype),
                                         out_dtype=dtype,   # the bias added to the float32
                                         use_fast_accum=    # sums, then one rounding to dtype
                                             the recipe's fast_accum)
              elsewhere (the emulation, the same quantization; SCALED_MM_DEVICES):
                  out = linear((xq.float() / scale_x).to(dtype), (wq.float() / scale_w).to(dtype),
                               bias.to(dtype))
              dtype: the region's lower-precision dtype; the output has it
    backward  gq = grad_output quantized to backward_dtype (its own scale, same recipe)
              gd, xd, wd = gq, xq, wq dequantized, to dtype
              grad_x = gd @ wd, grad_w = gd.T @ xd, grad_bias = grad_output.sum(0),
              each in its input's dtype; where the forward ran _scaled_mm and the
              scaling is tensorwise or delayed (one scale per operand), grad_x and grad_w
              are _scaled_mm(gq, wq) and _scaled_mm(gq.T, xq) with 1/scale each, grad_x out
              in dtype, grad_w out in the weight's dtype where that is float32 (its float32
              sums written once, never rounded to dtype first; weight_grad_dtype); row-wise
              scales lie along the backward's contraction: emulated

    scales    tensorwise : max / max(|t|)                 (amax floored at 1e-12)
              rowwise    : max / max(|row|) per row along the contraction dim: the rows
                           of x and of the weight (N, K), the rows of grad_output
              delayed    : max / max(history) of the operand (1 while the history is all
                           zero), then the history rolls by one and takes this call's
                           amax at [0]: a device tensor updated in place, no host sync.
                           One history (3 x amax_history: input, weight, grad_output) per
                           weight tensor, which must be a leaf (a parameter)

Calls the Function cannot take (a 1-D input or a batched second operand of matmul,
non-floating or float64 operands) run as ``lower_precision_fp`` does.
While ``ampkit.trace()`` records, each fp8 cast is noted with its dtype and scale
(:class:`Fp8Cast`) and the path that ran (``scaled_mm`` or ``emulated``).
While a diagnostic listens at ``ampkit._listeners.fp8_quantized`` (``ampkit.doctor`` in its
sampled steps), each cast is reported to it: the operand before the cast, its fp8 value and
the scale (no listener: one truth test of an empty tuple).

>>> import torch, ampkit
>>> lin = torch.nn.Linear(4, 3)
>>> with ampkit.autocast("cpu", policy="fp8"):
...     y = lin(torch.randn(2, 4))
>>> y.dtype
torch.bfloat16
"""

from __future__ import annotations

import dataclasses
import types
import weakref

import torch

from ampkit._fp8_transpose import transposed
from ampkit._listeners import fp8_quantized

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale
F32 = torch.float32
_ELIGIBLE = (torch.float32, torch.bfloat16, torch.float16)
_mm = torch.ops.aten.mm.default  # (backward: an ATen call, never re-cast by a policy)


# -- the math (the tests' oracle writes it again from the docstring) ----------------
def fp8_max(dtype) -> float:
    return torch.finfo(dtype).max


def amax(t, rowwise: bool):
    """``max(|t|)`` per row (``rowwise``) or of the whole tensor, float32. The whole
    tensor's is taken as the max of its rows' maxima (the same number: max is exact in any
    order), so that under torch.compile it is a reduction along the last dim, as a layer
    norm's or a softmax's are: inductor can then compute it in the kernel that makes ``t``
    (or that casts it, under delayed scaling) instead of reading ``t`` again, and only a
    small reduction over the rows' maxima is left."""
    rows = t.detach().abs().amax(dim=-1, keepdim=rowwise)
    return (rows if rowwise or t.dim() < 2 else rows.amax()).to(F32)


def scale_of(am, dtype):
    """``max / amax`` (amax floored), float32."""
    return fp8_max(dtype) / am.clamp(min=AMAX_FLOOR)


def scale_from_history(history, dtype):
    """The delayed scale of one operand: ``max / max(history)``, 1 while it is all zero."""
    hmax = history.amax()
    return torch.where(hmax > 0, fp8_max(dtype) / hmax.clamp(min=AMAX_FLOOR), torch.ones_like(hmax))


def push_amax(histories, row: int, am) -> None:
    """Roll ``histories[row]`` by one and write ``am`` at its [0], in place (no host sync).
    One copy_ into the whole (3, n) tensor: torch.compile's functionalization takes a
    whole-input mutation where a mutated row view breaks its partitioner."""
    rolled = torch.cat([am.reshape(1), histories[row, :-1]])
    mask = torch.arange(histories.shape[0], device=histories.device)[:, None] == row
    histories.copy_(torch.where(mask, rolled, histories))


def quantize(t, scale, dtype):
    m = fp8_max(dtype)
    return (t.to(F32) * scale).clamp(-m, m).to(dtype)


def dequantize(q, scale):
    return q.to(F32) / scale


# -- what the trace sees ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp8Cast:
    """One fp8 cast: the operand (``input``, ``weight``, ``grad_output``), its fp8 dtype and
    its scale (a float; a tuple of floats per row for rowwise scaling)."""

    operand: str
    dtype: str
    scale: object

    def __str__(self):
        s = self.scale
        shown = f"{s:.6g}" if isinstance(s, float) else f"[{min(s):.6g}..{max(s):.6g}] x{len(s)}"
        return f"{self.operand}:{self.dtype}*{shown}"


def _cast_of(operand, dtype, scale) -> Fp8Cast:
    vals = scale.detach().flatten().tolist()
    return Fp8Cast(operand, str(dtype).replace("torch.", ""), vals[0] if scale.dim() == 0 else tuple(vals))


# -- delayed scaling's histories --------------------------------------------------------
class _Histories:
    """Each weight's delayed-scaling histories: its (2, n) input and weight history and its
    (1, n) grad_output history, float32 on its device; two tensors, the first written by the
    forward, the second by the backward (torch.compile's partitioner refuses one input
    mutated in both). Kept per (weight, n) while the weight lives.

    Inside torch.compile the histories are graph inputs, written in place by the forward
    and by the backward (AOT autograd's functionalization writes them back), so delayed
    scaling compiles into the model's graph like the other recipes. That needs them to exist
    before the graph does: made while dynamo traces, they would be tensors the graph creates
    and hands out, which its backward then writes, and the partitioner refuses a forward
    output that depends on the backward (torch 2.13: "Node ... was invalid, but is output").
    So ``_ensure_histories``, which dynamo runs at trace time, makes them outside the graph
    and returns the name of the attribute of ``tensors`` that holds them. Attributes, not a
    dict: dynamo reads a dict once per trace and keeps that snapshot, which lacks the
    histories made after it (see ampkit._compiled_regions._Tables)."""

    def __init__(self):
        self.tensors = types.SimpleNamespace()  # h<i>: (history, grad_history)
        self.by_key = {}  # (id(weight), n) -> (weakref to the weight, attribute name)
        self.made = 0

    def get(self, weight, n):
        if not weight.is_leaf:
            raise RuntimeError(
                "ampkit fp8: delayed scaling keeps one amax history per weight, and this call's "
                "weight (second operand) is not a leaf tensor (a parameter), so it has no history "
                "from one step to the next; give this op tensorwise or rowwise scaling (a module "
                "scope can move it: policy.with_module(...)) or keep it out of the fp8 category")
        return getattr(self.tensors, _ensure_histories(weight, n))

    def ensure(self, weight, n) -> str:
        key = (id(weight), n)
        hit = self.by_key.get(key)
        if hit is not None and hit[0]() is weight:
            return hit[1]
        name = f"h{self.made}"
        self.made += 1
        setattr(self.tensors, name, (torch.zeros(2, n, dtype=F32, device=weight.device),
                                     torch.zeros(1, n, dtype=F32, device=weight.device)))
        self.by_key[key] = (weakref.ref(weight, lambda _, k=key, nm=name: self._forget(k, nm)), name)
        return name

    def _forget(self, key, name):
        if self.by_key.get(key, (None, None))[1] == name:
            del self.by_key[key]
        if hasattr(self.tensors, name):
            delattr(self.tensors, name)


HISTORIES = _Histories()


@torch._dynamo.assume_constant_result
def _ensure_histories(weight, n) -> str:
    """The attribute of ``HISTORIES.tensors`` that holds ``weight``'s histories of length
    ``n``, made here if it has none. In code that torch.compile traces: run at trace time
    with the real weight (a leaf: a parameter), outside the graph, which then reads the
    histories as inputs."""
    return HISTORIES.ensure(weight, n)


# -- the Function ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """A call's constants: what the Function needs besides its tensors."""

    op: str
    device_type: str
    dtype: torch.dtype  # the region's
    forward: torch.dtype
    backward: torch.dtype
    history: object  # delayed: the weight's (2, n) history of input and weight amaxes, else None
    grad_history: object  # delayed: its (1, n) history of grad_output amaxes, else None
    sink: object  # the active trace (its note_fp8 / record_fp8_backward) or None
    fast_accum: bool = False  # the forward _scaled_mm's use_fast_accum (the recipe's)


# Where _scaled_mm runs besides CUDA >= 8.9: torch's CPU build has a _scaled_mm too, which
# the tests turn on (scaled_mm_on_cpu) to run the GPU's path, layouts and scales on the CPU;
# shipped off, so the CPU runs the emulation, the definition the tests check bit for bit.
SCALED_MM_DEVICES = {"cuda"}


_CAPABILITIES = {}  # CUDA device index -> its compute capability


@torch._dynamo.assume_constant_result
def _capability(index):
    """A CUDA device's compute capability, asked of the driver once (every fp8 call looks).
    In code that torch.compile traces, run at trace time and kept as a constant: dynamo does
    not fold torch.cuda.get_device_capability (it lists it as an in-graph function that
    returns no tensor), and a device's capability never changes."""
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return cap


def _scaled_mm_fits(x2, w, plan, rowwise) -> bool:
    if plan.device_type not in SCALED_MM_DEVICES or x2.device.type != plan.device_type \
            or not hasattr(torch, "_scaled_mm"):
        return False
    if x2.is_cuda and _capability(x2.device.index) < (8, 9):
        return False
    m, k = x2.shape
    n = w.shape[0]
    if k % 16 or n % 16 or m % 16:
        return False
    return plan.dtype is torch.bfloat16 if rowwise else plan.dtype in (torch.bfloat16, torch.float16)


def _forward(ctx, scaling, x, w, b, plan):
    rowwise = scaling == "rowwise"
    x2 = x.reshape(-1, x.shape[-1])
    if scaling == "delayed":
        h = plan.history
        sx, sw = scale_from_history(h[0], plan.forward), scale_from_history(h[1], plan.forward)
        push_amax(h, 0, amax(x2, False))
        push_amax(h, 1, amax(w, False))
    else:
        sx, sw = scale_of(amax(x2, rowwise), plan.forward), scale_of(amax(w, rowwise), plan.forward)
    xq, wq = quantize(x2, sx, plan.forward), quantize(w, sw, plan.forward)
    if fp8_quantized.listeners:  # (a diagnostic watching the casts: ampkit.doctor)
        fp8_quantized.notify(plan.op, "input", x2, xq, sx)
        fp8_quantized.notify(plan.op, "weight", w, wq, sw)
    dt = plan.dtype
    if _scaled_mm_fits(x2, w, plan, rowwise):
        path = "scaled_mm"
        # the bias in _scaled_mm's epilogue: added to the float32 sums and rounded to dt once,
        # as torch's addmm does, with no second pass over the output
        out = torch._scaled_mm(xq.contiguous(), wq.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal().reshape(1, -1)
                               if rowwise else sw.reciprocal(), bias=None if b is None else b.to(dt), out_dtype=dt,
                               use_fast_accum=plan.fast_accum)
    else:
        path = "emulated"
        out = torch.nn.functional.linear(dequantize(xq, sx).to(dt), dequantize(wq, sw).to(dt),
                                         None if b is None else b.to(dt))
    ctx.save_for_backward(xq, sx, wq, sw)
    # no size on ctx: a size saved for the backward is an output of the forward's traced
    # subgraph, and on a retrace with automatic dynamic shapes one that the matmul's shape
    # check specializes (K, equal to the static weight's) breaks torch 2.11's autograd.Function
    # tracing (overwrite_tensor_vt_proxy's assert, issue 27); the backward reads the input's
    # size off grad (*x.shape[:-1], N) and the weight (N, K)
    ctx.plan, ctx.path = plan, path
    ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
    if plan.sink is not None:
        plan.sink.note_fp8((_cast_of("input", plan.forward, sx), _cast_of("weight", plan.forward, sw)), path)
    return out.reshape(*x.shape[:-1], w.shape[0])


def _backward(ctx, scaling, grad):
    plan = ctx.plan
    xq, sx, wq, sw = ctx.saved_tensors
    with torch._C.DisableTorchFunction(), torch.autocast(plan.device_type, enabled=False):
        g2 = grad.reshape(-1, grad.shape[-1])
        if scaling == "delayed":
            sg = scale_from_history(plan.grad_history[0], plan.backward)
            push_amax(plan.grad_history, 0, amax(g2, False))
        else:
            sg = scale_of(amax(g2, scaling == "rowwise"), plan.backward)
        dt = plan.dtype
        gq = quantize(g2, sg, plan.backward)
        if fp8_quantized.listeners:
            fp8_quantized.notify(plan.op, "grad_output", g2, gq, sg)
        x_dt, w_dt, b_dt = ctx.dtypes
        x_shape = (*grad.shape[:-1], wq.shape[1])
        gx = gw = gb = None
        # _scaled_mm where the forward took it and every scale is one number: a row-wise
        # scale of the weight (N) or of the input (M) would lie along the backward's
        # contraction dimension, which _scaled_mm cannot scale. Its operands' transposed
        # copies are made by ampkit.transposed, which inductor does not fuse into the
        # kernel that makes the operand (there the transposed store is strided: slow).
        if ctx.path == "scaled_mm" and scaling != "rowwise":
            path = "scaled_mm"
            inv_g = sg.reciprocal()
            if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): the second operand column-major
                gx = torch._scaled_mm(gq, transposed(wq).t(), scale_a=inv_g, scale_b=sw.reciprocal(),
                                      out_dtype=dt).reshape(x_shape).to(x_dt)
            if ctx.needs_input_grad[1]:  # (N, M) @ (M, K)
                gw = torch._scaled_mm(transposed(gq), transposed(xq).t(), scale_a=inv_g,
                                      scale_b=sx.reciprocal(), out_dtype=weight_grad_dtype(w_dt, dt)).to(w_dt)
        else:
            path = "emulated"
            gd = dequantize(gq, sg).to(dt)
            if ctx.needs_input_grad[0]:
                gx = _mm(gd, dequantize(wq, sw).to(dt)).reshape(x_shape).to(x_dt)
            if ctx.needs_input_grad[1]:
                gw = _mm(gd.t(), dequantize(xq, sx).to(dt)).to(w_dt)
        if b_dt is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(b_dt)
        if plan.sink is not None:
            plan.sink.record_fp8_backward(plan.op, plan.device_type, grad.dtype,
                                          (_cast_of("grad_output", plan.backward, sg),), path)
    return gx, gw, gb, None


def weight_grad_dtype(w_dt, dt):
    """The dtype _scaled_mm writes the weight's gradient in: the weight's own where it is
    float32 or ``dt`` (written once, in its final dtype: no ``dt`` copy read back and widened
    by a second kernel), else ``dt`` (then cast, as the emulation does)."""
    return w_dt if w_dt in (F32, dt) else dt


def _function(scaling):
    def forward(ctx, x, w, b, plan):
        return _forward(ctx, scaling, x, w, b, plan)

    def backward(ctx, grad):
        return _backward(ctx, scaling, grad)

    name = f"Fp8Linear{scaling.capitalize()}"
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__doc__": f"``input @ weight.T (+ bias)`` with fp8 operands, {scaling} scaling."})


FUNCTIONS = {s: _function(s) for s in ("tensorwise", "rowwise", "delayed")}


@torch.compiler.disable
def _apply_eagerly(Function, x, w, b, key, plan, n):
    """Delayed scaling inside torch.compile with a weight that is not a parameter (a leaf
    tensor the model makes, say): a graph break, the Function run eagerly. Only a parameter
    is known at trace time to be the same tensor at every call, whose histories the graph can
    take as inputs (a tensor made in the graph is another one at each call, with histories of
    its own)."""
    history, grad_history = HISTORIES.get(key, n)
    return Function.apply(x, w, b, dataclasses.replace(plan, history=history, grad_history=grad_history))


# -- the category's action ---------------------------------------------------------------
def _operands(name, func, args, kwargs):
    """(x, w as (N, K), bias, the tensor that keys the history) of a call, or None when the
    call is not one the Function takes."""
    if name == "linear":
        names = ("input", "weight", "bias")
    else:  # mm, matmul: input @ other
        names = ("input", "mat2" if name == "mm" else "other")
    vals = list(args) + [None] * (len(names) - len(args))
    for i, k in enumerate(names):
        if k in kwargs:
            vals[i] = kwargs[k]
    if set(kwargs) - set(names) or len(args) > len(names):
        return None
    if name == "linear":
        x, w, b = vals
        key = w
    else:
        x, other = vals[:2]
        if getattr(func, "__name__", "") == "__rmatmul__":  # other.__rmatmul__(x): x @ other
            x, other = other, x
        if not isinstance(other, torch.Tensor) or other.dim() != 2:
            return None
        w, b, key = other.t(), None, other
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() >= 2 and w.dim() == 2):
        return None
    if any(t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in _ELIGIBLE) for t in (x, w, b)):
        return None
    return x, w, b, key


def runner(name, recipe, device_type, on):
    """The fp8 category's cast of op ``name``: ``run(func, args, kwargs, dtype, sink)``, called
    with native autocast off; ``on(t)``: whether a tensor is on ``device_type``."""
    Function = FUNCTIONS[recipe.scaling]
    fwd, bwd = FP8_DTYPES[recipe.forward_dtype], FP8_DTYPES[recipe.backward_dtype]
    delayed = recipe.scaling == "delayed"

    def run(func, args, kwargs, dtype, sink):
        ops = _operands(name, func, args, kwargs)
        if ops is None or not all(on(t) for t in ops[:3] if t is not None):
            return _lower_precision(func, args, kwargs, dtype, on)
        x, w, b, key = ops
        if delayed and torch.compiler.is_compiling() and not isinstance(key, torch.nn.Parameter):
            return _apply_eagerly(Function, x, w, b, key, _Plan(name, device_type, dtype, fwd, bwd, None, None, sink,
                                                                          recipe.fast_accum),
                                  recipe.amax_history)
        history, grad_history = HISTORIES.get(key, recipe.amax_history) if delayed else (None, None)
        plan = _Plan(name, device_type, dtype, fwd, bwd, history, grad_history, sink, recipe.fast_accum)
        return Function.apply(x, w, b, plan)

    return run


def _lower_precision(func, args, kwargs, dtype, on):
    def cast(a):
        return a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype in _ELIGIBLE and on(a) else a

    return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
