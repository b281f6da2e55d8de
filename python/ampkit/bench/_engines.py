"""Across processes: the benchmark on torch's distributed engines (DDP, FSDP2).

``benchmarks/run.py --gpus N`` launches the Python runner under torchrun, once with one
process and once with N (one per GPU; on the CPU, gloo processes), and each process runs

    for each group of plan_groups(plan_runs(cases, engines, variants, check)):  # the same on every rank
        check:  make_train_step captured against eager on the engine (check_capture)
        runs:   run_interleaved(built, variants, placement=Placement(engine, ...))

A group of runs is the variants of one case and engine configuration: each is built and
warmed up, then the group runs ``repeats`` rounds of one timed epoch per variant, the
order rotating (round r starts at the (r mod k)-th of the k variants still running), so
that a ratio between two variants compares epochs of the same minutes: a host-bound eager
step drifts by tens of percent over a run, and variants timed one after the other each
met another part of that drift.
``repeats`` is the profile's, at least ``MIN_ROUNDS``, unless given (``repeats_for``).
``interleave=False`` (``--sequential``) times each variant alone, its epochs in a row,
as before; a compiled variant is timed alone across processes (``plan_groups``; in one
process, ``python -m ampkit.bench``, compiled variants share their case's group).

The timing protocol is the single-process one (``VariantRun``'s pieces, shared with
``run_variant``) with the placement's three hooks: the model is wrapped in the engine
before its optimizer is built; every clock read is preceded by a device sync and a
barrier; and each sample (and the peak memory) is the slowest rank's. After each piece
(a variant's build, warm-up, each epoch) the ranks agree on whether it failed, so that a
variant that fails is recorded as failed on every rank and the rest of its group goes on.
Rank 0 appends what happens to a JSON-lines file as it goes (the context, a ``start``
line before each check or group, naming its items, then their records or check), so that
when a rank stalls the launcher knows which items it was on, records them as failed and
starts again after them (``--from-item``). A stalled item cannot hang the suite: a
watchdog (``faulthandler.dump_traceback_later``, re-armed for the start-up, each check,
each piece of a group and the teardown) ends the process after ``run_timeout`` seconds
with every thread's stack on stderr (a group as a whole gets ``run_timeout`` per variant),
and torchrun then stops the other ranks.

Every rank trains on the same seeded batches (the timing does not depend on the values);
throughput is world size x batch size / step time, and the scaling efficiency of an
N-process record is the 1-process time over the N-process time of the same case,
variant, engine and options (``derive``).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import os
import sys
import time
from typing import Any

import torch

ENGINES = ("ddp", "fsdp2")
# DDP's own keyword arguments the runner passes through (the values DDP takes by default
# when absent): each is a choice that trades memory or generality for speed, the same
# for every variant of a run.
DDP_OPTIONS = {"gradient_as_bucket_view": bool, "static_graph": bool, "bucket_cap_mb": float}
CHECK_STEPS = 12
MIN_ROUNDS = 3  # the least rounds an interleaved group runs unless --repeats says otherwise
START_S = 120  # the least the watchdog gives the rendezvous and the teardown
# The layers FSDP2 shards one by one (then the root): the encoder and decoder layers of the cases.
SHARDED_LAYERS = ("EncoderLayer", "DecoderLayer")


def _parse_value(kind, key: str, text: str, spec: str):
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
    else:
        try:
            value = kind(text)
            if value > 0:
                return value
        except ValueError:
            pass
    want = "true or false" if kind is bool else "a positive number"
    raise ValueError("DDP option %r in %r: got %r, expected %s" % (key, spec, text, want))


@dataclasses.dataclass(frozen=True)
class Engine:
    """An engine and the options it is built with (sorted (key, value) pairs).

    >>> e = Engine.parse("ddp", "gradient_as_bucket_view=true,bucket_cap_mb=50")
    >>> e.options_dict(), e.label()
    ({'bucket_cap_mb': 50.0, 'gradient_as_bucket_view': True}, 'ddp (bucket_cap_mb=50, gradient_as_bucket_view)')
    """

    name: str
    options: tuple = ()

    @classmethod
    def parse(cls, name: str, spec: str = "") -> "Engine":
        if name not in ENGINES:
            raise ValueError("unknown engine %r; valid engines: %s" % (name, ", ".join(ENGINES)))
        opts = {}
        spec = spec.strip()
        if spec and spec != "default":
            if name != "ddp":
                raise ValueError("engine options are for ddp only, got %r for %s" % (spec, name))
            for item in spec.split(","):
                key, sep, text = item.partition("=")
                key = key.strip()
                if key not in DDP_OPTIONS or not sep:
                    raise ValueError("DDP option %r in %r: expected key=value with a key among %s"
                                     % (item, spec, ", ".join(DDP_OPTIONS)))
                opts[key] = _parse_value(DDP_OPTIONS[key], key, text.strip(), spec)
        return cls(name, tuple(sorted(opts.items())))

    def options_dict(self) -> dict:
        return dict(self.options)

    def label(self) -> str:
        if not self.options:
            return self.name
        shown = [k if v is True else "%s=%g" % (k, v) if isinstance(v, float) else "%s=%s" % (k, v)
                 for k, v in self.options]
        return "%s (%s)" % (self.name, ", ".join(shown))


def parse_engines(engines: str, ddp_options=None) -> list:
    """Engines from '--engines ddp,fsdp2' and any number of '--ddp-options SPEC' (each a
    DDP configuration to run: 'default' or key=value pairs among DDP_OPTIONS)."""
    names = [e.strip() for e in (engines or ",".join(ENGINES)).split(",") if e.strip()]
    if not names:
        raise ValueError("no engine given; valid engines: %s" % ", ".join(ENGINES))
    out = []
    for name in names:
        specs = (ddp_options or [""]) if name == "ddp" else [""]
        for spec in specs:
            engine = Engine.parse(name, spec)
            if engine not in out:
                out.append(engine)
    return out


@dataclasses.dataclass(frozen=True)
class Item:
    """One entry of the plan: a capture check (variant None) or a timed run."""

    kind: str  # "check" or "run"
    case: str
    engine: Engine
    variant: str | None = None

    def describe(self) -> str:
        what = self.variant if self.kind == "run" else "captured-vs-eager check"
        return "%s / %s / %s" % (self.case, self.engine.label(), what)


def plan_runs(cases, engines, variants, check: bool = False) -> list:
    """The items every rank runs, in order: per case, the checks (one per engine: its first
    configuration), then each engine configuration's variants. The launcher and the ranks
    build the same list."""
    items = []
    for case in cases:
        if check:
            firsts = list({e.name: e for e in reversed(engines)}.values())[::-1]
            items += [Item("check", case, e) for e in firsts]
        items += [Item("run", case, e, v) for e in engines for v in variants]
    return items


def repeats_for(case, profile: str, repeats=None, interleave: bool = True) -> int | None:
    """The timed epochs per variant across processes: ``repeats`` when given; else, for an
    interleaved group, its rounds: the profile's repeats, at least MIN_ROUNDS; else None
    (the profile's). ``case``: a name or a Case.

    >>> repeats_for("transformer", "tiny"), repeats_for("transformer", "tiny", 2)
    (3, 2)
    >>> repeats_for("transformer", "tiny", interleave=False) is None  # the profile's (1 here)
    True
    """
    if repeats is not None or not interleave:
        return repeats
    from ampkit.bench._spec import load_cases

    case = load_cases()[case] if isinstance(case, str) else case
    return max(int(case.profile(profile)["repeats"]), MIN_ROUNDS)


def plan_groups(items, start: int = 0, interleave: bool = True, variants=None) -> list:
    """items[start:] of the plan cut into what runs together, as lists of indices: a check
    alone; with ``interleave`` the consecutive runs of one case and engine configuration
    together, else every run alone. Each compiled variant runs alone (``variants``,
    {name: Variant}, says which are), and one in the middle of the variants would split
    their group: benchmarks/run.py lists the compiled ones last.

    >>> e = Engine("ddp")
    >>> items = [Item("check", "t", e)] + [Item("run", "t", e, v) for v in ("a", "b", "c")]
    >>> plan_groups(items), plan_groups(items, start=2), plan_groups(items, interleave=False)
    ([[0], [1, 2, 3]], [[2, 3]], [[0], [1], [2], [3]])
    """
    def alone(item):
        v = (variants or {}).get(item.variant)
        return item.kind != "run" or not interleave or (v is not None and v.compile != "none")

    groups: list = []
    for i in range(start, len(items)):
        item = items[i]
        last = items[groups[-1][-1]] if groups else None
        if groups and not alone(item) and not alone(last) and (last.case, last.engine) == (item.case, item.engine):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class Placement:
    """Where a variant runs across processes: the engine, this rank, the world size.

    The hooks ``VariantRun`` calls (``run_variant``, ``run_interleaved``): ``wrap`` (the
    model in the engine), ``sync`` (device sync and barrier before a clock read),
    ``slowest`` (each rank's values -> the max) and ``first_error`` (every rank agrees).
    """

    def __init__(self, engine: Engine, device: str, world_size: int | None = None):
        """``world_size``: given, a description only (the launcher's, for the records of
        runs that never finished); None, this process's place in the running group."""
        import torch.distributed as dist

        self.dist = dist
        self.engine = engine
        self.device = device
        self.world_size = dist.get_world_size() if world_size is None else int(world_size)
        self.rank = dist.get_rank() if world_size is None else None

    def warmup_steps(self, variant, profile_warmup: int, step=None) -> int:
        """Untimed steps: the profile's, and on CUDA for a built train step ``step`` enough
        for its capture to have happened (its own warm-up, ``step.warmup``, which
        make_train_step chooses; the capture; one replay) before the clock starts (one that
        never captures, ``capture: false``, needs none of that)."""
        warm = variant.warmup_steps(profile_warmup)
        if step is not None and variant.runner == "train_step" and variant.capture is not False \
                and self.device == "cuda":
            warm = max(warm, step.warmup + 2)
        return warm

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.engine.name == "ddp":
            kw = self.engine.options_dict()
            if self.device != "cuda":
                return torch.nn.parallel.DistributedDataParallel(model, **kw)
            # Built on a side stream, as torch's CUDA-graph notes ask of a DDP to capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                wrapped = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[torch.cuda.current_device()], **kw)
            torch.cuda.current_stream().wait_stream(side)
            return wrapped
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6: FSDP2 lived here
            from torch.distributed._composable.fsdp import fully_shard

        for m in model.modules():
            if m is not model and type(m).__name__ in SHARDED_LAYERS:
                fully_shard(m)
        return fully_shard(model)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.dist.barrier()

    def slowest(self, values):
        """The max over ranks of each value (a list of floats; None stays None)."""
        if not values or values[0] is None:
            return values
        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device="cuda" if self.device == "cuda" else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def first_error(self, error):
        """None when no rank failed, else the first failing rank's error, on every rank
        (so that every rank records the same failure and goes on to the same next run)."""
        if self.all_agree(error is None):
            return None
        errors: list = [None] * self.world_size
        self.dist.all_gather_object(errors, error)
        return next("rank %d: %s" % (r, e) for r, e in enumerate(errors) if e is not None)

    def all_agree(self, ok: bool) -> bool:
        """True when ``ok`` on every rank (one small all-reduce)."""
        t = torch.tensor([1.0 if ok else 0.0], device="cuda" if self.device == "cuda" else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item() == 1.0)


def check_capture(placement: Placement, built, steps: int = CHECK_STEPS) -> dict:
    """make_train_step captured against eager on the same data: losses and this rank's
    parameters (its shard under FSDP2), bitwise, a second eager run to tell kernels that
    are not deterministic from a capture that differs, and for DDP the replicas agreeing
    across ranks. On the CPU nothing is captured (the 'auto' run is eager too)."""
    import ampkit

    dist, device = placement.dist, placement.device
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    runs = {}
    for capture in (False, "again", "auto"):
        torch.manual_seed(0)
        model = placement.wrap(built.new_model())
        opt = built.new_optimizer(model, fused=True)
        step = ampkit.make_train_step(model, built.loss_fn, opt, scaler=ampkit.GradScaler(device),
                                      autocast=dict(device_type=device, dtype=dtype),
                                      capture=False if capture == "again" else capture)
        losses = [step(*built.batches[i % built.num_batches]).item() for i in range(steps)]
        params = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]
        runs[capture] = (losses, params, step.captures, step.reason)
    (le, pe, _, _), (la, pa, _, _), (lc, pc, captures, reason) = runs[False], runs["again"], runs["auto"]
    out = {"eager_repeatable": la == le and all(torch.equal(a, b) for a, b in zip(pe, pa)),
           "captured": captures > 0, "eager_reason": None if captures else reason,
           "losses_equal": le == lc, "params_equal": all(torch.equal(a, b) for a, b in zip(pe, pc)),
           "max_param_diff": max((float((a.float() - b.float()).abs().max()) for a, b in zip(pe, pc)
                                  if a.numel()), default=0.0),
           "last_loss_eager": le[-1], "last_loss_captured": lc[-1]}
    if placement.engine.name == "ddp":
        total = torch.stack([p.double().sum() for p in pc]).sum().reshape(1)
        every = [torch.zeros_like(total) for _ in range(placement.world_size)]
        dist.all_gather(every, total)
        out["replicas_agree"] = all(torch.equal(every[0], t) for t in every)
    out["all_ranks_equal"] = placement.all_agree(out["losses_equal"] and out["params_equal"])
    return out


class Events:
    """Rank 0's JSON-lines log of the launch (the other ranks write nothing)."""

    def __init__(self, path, rank: int):
        self.f = open(path, "a") if rank == 0 else None

    def write(self, **event) -> None:
        if self.f is not None:
            self.f.write(json.dumps(event) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def init_process_group(device: str, timeout_s: float) -> None:
    """gloo on the CPU, NCCL on CUDA (as a user would: make_train_step captures NCCL's
    collectives without TORCH_NCCL_ASYNC_ERROR_HANDLING=0, its capture being thread-local)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _before(deadline) -> bool:
    """Whether every rank is still before the deadline (rank 0's clock decides)."""
    import torch.distributed as dist

    if deadline is None:
        return True
    t = torch.tensor([1.0 if time.time() < deadline else 0.0],
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, src=0)
    return bool(t.item() == 1.0)


def not_run(item, reason: str, *, profile: str, device: str, world: int, repeats, interleave: bool = True):
    """(record, check) of an item left out (skipped, with the reason)."""
    import ampkit.bench as bench

    if item.kind == "check":
        return None, dict(case=item.case, engine=item.engine.name, engine_options=item.engine.options_dict(),
                          world_size=world, skipped=reason)
    run = bench.resolve_run(bench.load_cases()[item.case], bench.load_variants()[item.variant], "python", profile,
                            device, repeats=repeats_for(item.case, profile, repeats, interleave),
                            placement=Placement(item.engine, device, world_size=world))
    return bench.make_record(run, status="skipped", reason=reason), None


def run_items(items, start: int, *, profile: str, device: str, seed: int, repeats, out: str,
              run_timeout: float, deadline: float | None = None, interleave: bool = True) -> None:
    """The worker: items[start:] of the plan on this rank, logged by rank 0 to ``out``, the
    runs of each case and engine configuration interleaved (``plan_groups``; with
    ``interleave=False`` each alone). ``deadline`` (a ``time.time()``): the items not
    started by then are recorded as skipped, with the reason."""
    import torch.distributed as dist

    import ampkit.bench as bench
    from ampkit.bench._results import context
    from ampkit.bench._runner import progress

    if "WORLD_SIZE" not in os.environ:
        raise RuntimeError("the --engines runner runs under torchrun (python -m torch.distributed.run "
                           "--nproc-per-node N -m ampkit.bench ...); benchmarks/run.py --gpus N launches it")
    # The watchdog covers everything after the imports: the rendezvous and the teardown
    # (within max(run_timeout, START_S)) and each item, its case's build included.
    faulthandler.dump_traceback_later(max(run_timeout, START_S), exit=True, file=sys.stderr)
    # (the rendezvous gets the start-up's time, not one run's: a short --run-timeout gave
    # gloo's store that timeout, and a loaded machine's rendezvous failed before any item;
    # a collective that stalls inside an item is the watchdog's, at run_timeout)
    init_process_group(device, max(run_timeout, START_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    events = Events(out, rank)
    variants = bench.load_variants()
    try:
        if start == 0:
            events.write(context=context(profile, device, "python", seed=seed), world_size=world)
        built = None
        for group in plan_groups(items, start, interleave, variants):
            i, item = group[0], items[group[0]]
            if not _before(deadline):
                reason = "not run: the time budget (--budget) ran out before it"
                for j in range(i, len(items)):
                    rec, chk = not_run(items[j], reason, profile=profile, device=device, world=world, repeats=repeats,
                                       interleave=interleave)
                    events.write(index=j, **({"record": rec} if rec is not None else {"check": chk}))
                if rank == 0:
                    print("[ranks x%d] %d item(s) %s" % (world, len(items) - i, reason), file=sys.stderr, flush=True)
                break
            names = [items[j].variant for j in group]
            what = item.describe() if len(group) == 1 else "%s / %s / %s interleaved" % (
                item.case, item.engine.label(), ", ".join(names))
            events.write(start=i, items=group, item=what)
            # A check, or a group's case build: run_timeout; then each piece of a group
            # (a variant's build, warm-up, an epoch) at most run_timeout, the group as a
            # whole at most run_timeout per variant.
            faulthandler.dump_traceback_later(run_timeout, exit=True, file=sys.stderr)
            t0 = time.perf_counter()
            if built is None or built.name != item.case:
                built = None  # free the previous case's batches first
                built = bench.build_case(item.case, profile, seed=seed, device=device,
                                         repeats=repeats_for(item.case, profile, repeats, interleave))
            placement = Placement(item.engine, device)
            if item.kind == "check":
                try:
                    found = check_capture(placement, built)
                except Exception as e:  # noqa: BLE001 - recorded
                    found = {"error": " ".join(("%s: %s" % (type(e).__name__, e)).split())[:600]}
                events.write(index=i, check=dict(case=item.case, engine=item.engine.name,
                                                 engine_options=item.engine.options_dict(),
                                                 world_size=world, wall_s=round(time.perf_counter() - t0, 2),
                                                 **found))
                if rank == 0:
                    print("[ranks x%d %d/%d] %s: %s" % (world, i + 1, len(items), item.describe(),
                                                        json.dumps(found)), file=sys.stderr, flush=True)
            else:
                if rank == 0 and len(group) > 1:
                    print("[ranks x%d] %s / %s: %s, %d rounds in turn" % (
                        world, item.case, item.engine.label(), ", ".join(names), built.repeats),
                        file=sys.stderr, flush=True)
                ends = time.monotonic() + run_timeout * len(group)

                def arm(ends=ends):
                    left = min(run_timeout, ends - time.monotonic())
                    faulthandler.dump_traceback_later(max(left, 0.001), exit=True, file=sys.stderr)

                recs = bench.run_interleaved(built, [variants[n] for n in names], language="python",
                                             placement=placement, before_piece=arm)
                for j, rec in zip(group, recs):
                    events.write(index=j, record=rec)
                    if rank == 0:
                        progress("ranks x%d" % world, j + 1, len(items), dict(rec, case="%s / %s" % (
                            rec["case"], item.engine.label())))
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        events.close()
        faulthandler.dump_traceback_later(max(run_timeout, START_S), exit=True, file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def read_events(path) -> dict:
    """What a launch's rank 0 logged: {'context', 'world_size', 'records': {index: rec},
    'checks': {index: check}, 'started': the first index of the last check or group
    started, or None, 'started_items': all the indices of that check or group ([] if none)}."""
    got: dict[str, Any] = {"context": None, "world_size": None, "records": {}, "checks": {}, "started": None,
                           "started_items": []}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return got
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:  # a line cut short when the process was killed
            continue
        if "context" in ev:
            got["context"], got["world_size"] = ev["context"], ev["world_size"]
        elif "start" in ev:
            got["started"], got["started_items"] = ev["start"], list(ev.get("items", [ev["start"]]))
        elif "record" in ev:
            got["records"][ev["index"]] = ev["record"]
        elif "check" in ev:
            got["checks"][ev["index"]] = ev["check"]
    return got
