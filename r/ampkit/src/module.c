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
static SEXP r_rel, r_pend, r_fallback, r_py_to_r;
static PyObject *py_call_releasing;
static SEXP sym_update, sym_released, sym_every, sym_option;

static SEXP ring, kept;      /* the two rings (R lists, preserved) */
static int keep_n, kept_n;  /* their sizes */
static int ring_at, kept_at; /* the element filled last */
static int every_min, every_max, every, calls;
static int base = -1;        /* the count of an output held only by its element; -1: off */
static int calibrating = 0;

SEXP ampkit_release_setup(SEXP rel, SEXP pend, SEXP sizes, SEXP fns) {
  if (TYPEOF(sizes) != INTSXP || XLENGTH(sizes) != 4 || TYPEOF(fns) != VECSXP || XLENGTH(fns) != 3)
    Rf_error("ampkit_release_setup: bad arguments");
  r_rel = rel;
  r_pend = pend;
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
  sym_update = Rf_install("update");
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
  if (++calls >= every) {
    calls = 0;
    for (int j = 0; j < kept_n && !any_kept; j++) any_kept = VECTOR_ELT(kept, j) != R_NilValue;
    scan_kept = any_kept;
  }
  if (base < 1) {
    if (scan_kept) set_every(every_max < 2 * every ? every_max : 2 * every);
    return R_NilValue;
  }
  int from_kept = 0;
  if (scan_kept)
    for (int j = 0; j < kept_n; j++) from_kept += dropped(VECTOR_ELT(kept, j));
  n = from_kept;
  for (int k = 0; k < keep_n; k++) n += dropped(VECTOR_ELT(ring, k));
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
  calibrating = Rf_asLogical(calibrate) == TRUE;
  if (calibrating) base = -1;
  return R_NilValue;
}

/* After the probe: the count of the output it left, which nothing else holds, is the
 * count of a dropped output. Returns it (< 1: the release stays off). */
SEXP ampkit_release_calibrated(void) {
  SEXP last = ring == NULL ? R_NilValue : VECTOR_ELT(ring, ring_at);
  base = last == R_NilValue ? -1 : REFCNT(last);
  calibrating = 0;
  ampkit_release_forget(Rf_ScalarLogical(FALSE));
  return Rf_ScalarInteger(base);
}

/* reticulate's py_to_r(x) (S3 dispatch), for a converting module's other results. */
static SEXP eval2(SEXP f, SEXP x) {
  PROTECT(x);
  SEXP call = PROTECT(Rf_lang2(f, x));
  SEXP res = Rf_eval(call, R_GlobalEnv);
  UNPROTECT(2);
  return res;
}

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
  if (ok) {
    PyObject *before = NULL, *first[2] = {NULL, fobj};
    SEXP u = Rf_findVarInFrame(r_pend, sym_update);
    if (u != R_UnboundValue && u != R_NilValue) {
      before = env_object(Rf_getAttrib(u, sym_py_object), NULL);
      PROTECT(u);
      Rf_defineVar(sym_update, R_NilValue, r_pend);
    } else {
      PROTECT(u = R_NilValue);
    }
    if (dead == R_NilValue) {
      res = call_python(before, fobj, NULL, 0, &a, convert);
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
      res = first[0] == NULL ? call_python(before, fobj, NULL, 0, &a, convert)
                             : call_python(before, py_call_releasing, first, 2, &a, convert);
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
  else if (convert) res = eval2(r_py_to_r, res);
  UNPROTECT(2);
  return res;
}
