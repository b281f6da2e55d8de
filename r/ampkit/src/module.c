/* A module call from R (`output <- net(x)`, `loss <- loss_fn(output, y)`) in one
 * crossing, with the release of the module outputs R has dropped (R/memory.R says why
 * and how; this is its compiled twin, used with the compiled crossing).
 *
 * .External(ampkit_module, obj, ...) calls the Python callable of `obj` with `...`
 * (reticulate's conversion of each argument: a Python object, NULL, a plain scalar),
 * after the scaler update that `$update()` deferred, if any (R/scaler.R), and after
 * handing the outputs of earlier calls that no R binding references any more to the
 * bridge's release (r_bridge.call_releasing), all in the same call into Python. A tensor
 * result is watched in the rings below; any other result is converted as reticulate
 * converts it when the callable converts. A Python exception is reticulate's R error.
 *
 * The rings hold the watched outputs in the elements of two R lists: an element
 * replaced or cleared lowers R's reference count of what it held, as an environment
 * binding does in R/memory.R. An output is dropped when its count is at most what an
 * output held by nothing but its element reads (measured once, on a tensor that takes
 * this path: ampkit_release_calibrated()).
 */
#include "crossing.h"

/* .rel (R/memory.R's state: `released` and `every` are kept up to date there), .pend
 * (the deferred update), the bridge's call_releasing, the R fallback of a call whose
 * arguments do not convert here, and reticulate's py_to_r(). */
static SEXP r_rel, r_fallback, r_py_to_r;
static PyObject *py_call_releasing;
static SEXP sym_released, sym_every, sym_option;
static double dropped_refs = 0;  /* outputs whose Python reference R dropped (tests) */

static SEXP ring, kept;      /* the two rings (R lists, preserved) */
static int keep_n, kept_n;  /* their sizes */
static int ring_at, kept_at; /* the element filled last */
static int every_min, every_max, every, calls;
static int base = -1;        /* the count of an output held only by its element; -1: off */
static int xp_base = -1;     /* the count of its external pointer */
static int calibrating = 0;

SEXP ampkit_release_setup(SEXP rel, SEXP sizes, SEXP fns) {
  if (TYPEOF(sizes) != INTSXP || XLENGTH(sizes) != 4 || TYPEOF(fns) != VECSXP || XLENGTH(fns) != 3)
    Rf_error("ampkit_release_setup: bad arguments");
  r_rel = rel;
  r_fallback = VECTOR_ELT(fns, 0);
  r_py_to_r = VECTOR_ELT(fns, 1);
  py_call_releasing = env_object(VECTOR_ELT(fns, 2), NULL);
  if (py_call_releasing == NULL) Rf_error("ampkit_release_setup: call_releasing is not a Python object");
  R_PreserveObject(r_fallback);
  R_PreserveObject(r_py_to_r);
  R_PreserveObject(VECTOR_ELT(fns, 2));  /* keeps call_releasing alive */
  keep_n = INTEGER(sizes)[0];
  kept_n = INTEGER(sizes)[1];
  every_min = every = INTEGER(sizes)[2];
  every_max = INTEGER(sizes)[3];
  if (ring == NULL) {
    ring = Rf_allocVector(VECSXP, keep_n);
    R_PreserveObject(ring);
    kept = Rf_allocVector(VECSXP, kept_n);
    R_PreserveObject(kept);
  }
  sym_released = Rf_install("released");
  sym_every = Rf_install("every");
  sym_option = Rf_install("ampkit.release_outputs");
  ring_at = keep_n - 1;
  kept_at = kept_n - 1;
  return R_NilValue;
}

static void set_every(int value) {
  if (value == every) return;
  every = value;
  Rf_defineVar(sym_every, Rf_ScalarInteger(every), r_rel);
}

static void count_released(int n) {
  SEXP now = Rf_findVarInFrame(r_rel, sym_released);
  int before = TYPEOF(now) == INTSXP && XLENGTH(now) == 1 ? INTEGER(now)[0] : 0;
  Rf_defineVar(sym_released, Rf_ScalarInteger(before + n), r_rel);
}

static int dropped(SEXP x) { return x != R_NilValue && REFCNT(x) <= base; }

/* The watched outputs no R binding references any more, taken out of the rings: an R
 * list, or R_NilValue when there are none. The second ring is scanned every `every`
 * calls; a scan that finds nothing doubles the interval (up to every_max). */
static SEXP take_dropped(void) {
  int scan_kept = 0, n = 0, any_kept = 0;
  /* (the scans read the rings in place: VECTOR_ELT() is a call into R each time) */
  const SEXP *ring_slot = (const SEXP *) DATAPTR_RO(ring), *kept_slot = (const SEXP *) DATAPTR_RO(kept);
  if (++calls >= every) {
    calls = 0;
    for (int j = 0; j < kept_n && !any_kept; j++) any_kept = kept_slot[j] != R_NilValue;
    scan_kept = any_kept;
  }
  if (base < 1) {
    if (scan_kept) set_every(every_max < 2 * every ? every_max : 2 * every);
    return R_NilValue;
  }
  int from_kept = 0;
  if (scan_kept)
    for (int j = 0; j < kept_n; j++) from_kept += dropped(kept_slot[j]);
  n = from_kept;
  for (int k = 0; k < keep_n; k++) n += dropped(ring_slot[k]);
  if (scan_kept) set_every(from_kept ? every_min : (every_max < 2 * every ? every_max : 2 * every));
  if (n == 0) return R_NilValue;
  SEXP out = PROTECT(Rf_allocVector(VECSXP, n));
  int i = 0;
  if (from_kept) {
    for (int j = 0; j < kept_n && i < n; j++) {
      if (dropped(VECTOR_ELT(kept, j))) {
        SET_VECTOR_ELT(out, i++, VECTOR_ELT(kept, j));
        SET_VECTOR_ELT(kept, j, R_NilValue);
      }
    }
  }
  for (int k = 0; k < keep_n && i < n; k++) {
    if (dropped(VECTOR_ELT(ring, k))) {
      SET_VECTOR_ELT(out, i++, VECTOR_ELT(ring, k));
      SET_VECTOR_ELT(ring, k, R_NilValue);
    }
  }
  count_released(n);
  UNPROTECT(1);
  return out;
}

static int release_on(void) {
  SEXP v = Rf_GetOption1(sym_option);
  return v == R_NilValue || (TYPEOF(v) == LGLSXP && XLENGTH(v) == 1 && LOGICAL(v)[0] == TRUE);
}

/* Watch a tensor result: the oldest output, if still referenced, moves to the second
 * ring (replacing that ring's oldest, which is left to R's collector). */
static void keep_output(SEXP x) {
  if ((base < 1 && !calibrating) || !release_on()) return;
  ring_at = (ring_at + 1) % keep_n;
  SEXP old = VECTOR_ELT(ring, ring_at);
  if (old != R_NilValue) {
    kept_at = (kept_at + 1) % kept_n;
    SET_VECTOR_ELT(kept, kept_at, old);
  }
  SET_VECTOR_ELT(ring, ring_at, x);
}

/* ampkit_release_forget(calibrating): let go of the watched outputs; with `calibrating`
 * TRUE, watch the next output whatever the count (the calibration's probe). */
SEXP ampkit_release_forget(SEXP calibrate) {
  if (ring == NULL) return R_NilValue;
  for (int k = 0; k < keep_n; k++) SET_VECTOR_ELT(ring, k, R_NilValue);
  for (int j = 0; j < kept_n; j++) SET_VECTOR_ELT(kept, j, R_NilValue);
  calls = 0;  /* a fresh start: the interval learnt on what was watched goes too */
  set_every(every_min);
  calibrating = Rf_asLogical(calibrate) == TRUE;
  if (calibrating) base = xp_base = -1;
  return R_NilValue;
}

/* While R collects (R/memory.R's collect_memory()): the rings hold every watched output,
 * so no collection could free one that only R's garbage references (a list rebound each
 * step that held it). ampkit_release_collecting(TRUE) moves each watched output to a weak
 * reference (its element emptied); ampkit_release_collecting(FALSE), after the
 * collection, puts back in its element each one that survived, and clears the weak
 * references, which drops the count they added (a live output bound in a frame reads as
 * before, so the release still lets it go once it is dropped). */
static SEXP weak;  /* the weak references, by element: the ring's, then the second ring's */

static void to_weak(SEXP list, int i, int at) {
  SEXP x = VECTOR_ELT(list, i);
  if (x == R_NilValue) return;
  SET_VECTOR_ELT(weak, at, R_MakeWeakRef(x, R_NilValue, R_NilValue, FALSE));
  SET_VECTOR_ELT(list, i, R_NilValue);
}

static void from_weak(SEXP list, int i, int at) {
  SEXP w = VECTOR_ELT(weak, at);
  if (w == R_NilValue) return;
  SEXP x = PROTECT(R_WeakRefKey(w));
  R_RunWeakRefFinalizer(w);  /* (no finalizer: it only clears the reference) */
  SET_VECTOR_ELT(weak, at, R_NilValue);
  SEXP xp = x == R_NilValue ? R_NilValue : Rf_findVarInFrame(x, sym_pyobj);
  if (TYPEOF(xp) == EXTPTRSXP && R_ExternalPtrAddr(xp) != NULL) SET_VECTOR_ELT(list, i, x);
  UNPROTECT(1);
}

SEXP ampkit_release_collecting(SEXP start) {
  if (ring == NULL) return R_NilValue;
  if (weak == NULL) {
    weak = Rf_allocVector(VECSXP, keep_n + kept_n);
    R_PreserveObject(weak);
  }
  int to = Rf_asLogical(start) == TRUE;
  for (int k = 0; k < keep_n; k++) (to ? to_weak : from_weak)(ring, k, k);
  for (int j = 0; j < kept_n; j++) (to ? to_weak : from_weak)(kept, j, keep_n + j);
  return R_NilValue;
}

/* After the probe: the count of the output it left, which nothing else holds, is the
 * count of a dropped output. Returns it (< 1: the release stays off). */
SEXP ampkit_release_calibrated(void) {
  SEXP last = ring == NULL ? R_NilValue : VECTOR_ELT(ring, ring_at);
  base = last == R_NilValue ? -1 : REFCNT(last);
  SEXP xp = last == R_NilValue ? R_NilValue : Rf_findVarInFrame(last, sym_pyobj);
  xp_base = TYPEOF(xp) == EXTPTRSXP ? REFCNT(xp) : -1;
  calibrating = 0;
  ampkit_release_forget(Rf_ScalarLogical(FALSE));
  return Rf_ScalarInteger(base);
}

/* Whether nothing in R reaches the Python object of a dropped output but the output
 * itself: its external pointer reads the count of the calibration's output, which only
 * that output's binding (and its finalizer) held. A carrier made for it (py_arg() in
 * R/package.R) holds the pointer too: such an output takes the bridge's release instead.
 * (R's counts never count too few.) */
static int sole_holder(SEXP xp) { return xp_base >= 1 && REFCNT(xp) <= xp_base; }

/* Let go of R's Python reference to the dropped outputs that nothing else in R reaches,
 * as R's collector will when it frees them, but now: Python frees what nothing else holds,
 * as in a Python loop where `output = net(x)` rebinds `output`. They leave `dead`; the
 * others stay, for the bridge's release (r_bridge.release_tensors). Returns how many were
 * let go. */
static int let_go(SEXP dead) {
  int n = 0;
  PyObject *objs[64];
  R_xlen_t len = XLENGTH(dead);
  for (R_xlen_t i = 0; i < len && n < 64; i++) {
    SEXP env = VECTOR_ELT(dead, i);
    SEXP xp = Rf_findVarInFrame(env, sym_pyobj);
    if (TYPEOF(xp) != EXTPTRSXP || R_ExternalPtrAddr(xp) == NULL || !sole_holder(xp)) continue;
    objs[n++] = (PyObject *) R_ExternalPtrAddr(xp);
    R_ClearExternalPtr(xp);  /* (its finalizer then has nothing to do) */
    SET_VECTOR_ELT(dead, i, R_NilValue);
  }
  if (n) {
    PyGILState_STATE g = py.GILState_Ensure();
    for (int i = 0; i < n; i++) py.DecRef(objs[i]);
    py.GILState_Release(g);
    dropped_refs += n;
  }
  return n;
}

/* Before a call of the hot path (callx(): a backward pass, an optimizer step, zero_grad):
 * let go of the watched outputs of the first ring that no R binding references and whose
 * Python object nothing else in R reaches, as the next module call would, but now. A loop
 * written as Python's (`loss <- loss_fn(model(x), y)`) then holds no logits through the
 * backward pass, as in Python, where they are freed once the loss is computed (R held
 * them until the next step's first module call: the transformer's 1 GiB in float32, its
 * R peak 1.13x Python's). Those a carrier still reaches wait for the next module call's
 * release through the bridge. A few reference counts a call when nothing was dropped. */
void release_dropped(void) {
  if (ring == NULL || base < 1 || calibrating) return;
  /* (read in place: VECTOR_ELT() and the empty slots' checks were most of its cost) */
  const SEXP *slot = (const SEXP *) DATAPTR_RO(ring);
  int any = 0;
  for (int k = 0; k < keep_n && !any; k++) any = slot[k] != R_NilValue && REFCNT(slot[k]) <= base;
  if (!any || !release_on()) return;
  PyObject *objs[64];
  int n = 0;
  for (int k = 0; k < keep_n && n < 64; k++) {
    SEXP x = VECTOR_ELT(ring, k);
    if (!dropped(x)) continue;
    SEXP xp = Rf_findVarInFrame(x, sym_pyobj);
    if (TYPEOF(xp) != EXTPTRSXP || R_ExternalPtrAddr(xp) == NULL || !sole_holder(xp)) continue;
    objs[n++] = (PyObject *) R_ExternalPtrAddr(xp);
    R_ClearExternalPtr(xp);  /* (its finalizer then has nothing to do) */
    SET_VECTOR_ELT(ring, k, R_NilValue);
  }
  if (!n) return;
  PyGILState_STATE g = py.GILState_Ensure();
  for (int i = 0; i < n; i++) py.DecRef(objs[i]);
  py.GILState_Release(g);
  dropped_refs += n;
  count_released(n);
}

/* ampkit_release_counts(): the outputs whose Python reference was let go so far. */
SEXP ampkit_release_counts(void) { return Rf_ScalarReal(dropped_refs); }


SEXP ampkit_module(SEXP args) {
  args = CDR(args);  /* the routine */
  SEXP obj = CAR(args), rest = CDR(args);
  int convert = 1;
  call_args a;
  PyObject *fobj = crossing_ready && ring != NULL ? env_object(obj, &convert) : NULL;
  if (fobj == NULL) Rf_error("ampkit: the compiled module call is not ready");
  int ok = args_from_pairlist(&a, rest);
  SEXP dead = PROTECT(take_dropped());
  SEXP res;
  if (dead != R_NilValue && let_go(dead) == XLENGTH(dead)) dead = R_NilValue;
  else if (dead != R_NilValue) {  /* the others, for the bridge's release */
    R_xlen_t n = 0;
    for (R_xlen_t i = 0; i < XLENGTH(dead); i++) n += VECTOR_ELT(dead, i) != R_NilValue;
    SEXP rest_dead = Rf_allocVector(VECSXP, n);
    for (R_xlen_t i = 0, j = 0; i < XLENGTH(dead); i++)
      if (VECTOR_ELT(dead, i) != R_NilValue) SET_VECTOR_ELT(rest_dead, j++, VECTOR_ELT(dead, i));
    UNPROTECT(1);
    dead = PROTECT(rest_dead);
  }
  if (ok) {
    PyObject *first[2] = {NULL, fobj};
    SEXP u;
    PyObject *before = pending_update(&u);
    PROTECT(u);
    if (dead == R_NilValue) {
      res = call_python(before, fobj, NULL, 0, &a, convert, R_NilValue, MODE_REF);
    } else {  /* call_releasing(dead, fobj, ...): the release in the same call */
      PyGILState_STATE g = py.GILState_Ensure();
      first[0] = py.List_New(XLENGTH(dead));
      for (R_xlen_t i = 0; first[0] != NULL && i < XLENGTH(dead); i++) {
        PyObject *o = env_object(VECTOR_ELT(dead, i), NULL);
        py.IncRef(o);
        py.List_SetItem(first[0], i, o);  /* (steals `o`) */
      }
      if (first[0] == NULL) py.Err_Clear();
      else py.IncRef(fobj);
      py.GILState_Release(g);
      res = first[0] == NULL ? call_python(before, fobj, NULL, 0, &a, convert, R_NilValue, MODE_REF)
                             : call_python(before, py_call_releasing, first, 2, &a, convert, R_NilValue, MODE_REF);
    }
    UNPROTECT(1);
  } else {
    /* module_fallback(obj, dead, list(...)): the R path through reticulate */
    SEXP rargs = PROTECT(Rf_PairToVectorList(rest));
    SEXP call = PROTECT(Rf_lang4(r_fallback, obj, dead, rargs));
    res = Rf_eval(call, R_GlobalEnv);
    UNPROTECT(2);
  }
  PROTECT(res);
  if (Rf_inherits(res, "torch.Tensor")) keep_output(res);
  else if (convert) res = eval_r(r_py_to_r, res);  /* reticulate's py_to_r() */
  UNPROTECT(2);
  return res;
}
