/* The compiled crossing: R's calls into Python on the hot path (regions, module and
 * loss calls, the scaler's and the optimizer's per-step calls), made through Python's C
 * API on the objects reticulate already holds, in the interpreter reticulate started.
 *
 * One call is what reticulate 1.28's py_call_impl() does (arguments converted, the
 * callable called with the GIL taken by PyGILState_Ensure(), the result wrapped as
 * reticulate wraps it), without reticulate's per-call costs (Rcpp's argument objects,
 * the exception handling frames, the class vector of the result built by walking the
 * type's MRO in Python on every call). So that what R sees does not change:
 *
 * - a result is an object of reticulate's own form: an environment holding `pyobj` (an
 *   external pointer to the object, which drops its reference when R collects it) and
 *   `convert` (the callable's flag), with reticulate's class vector. That vector is made
 *   by reticulate itself the first time a Python class comes back (the object is handed
 *   to reticulate through `take()`, a Python function of this file), and reused for the
 *   next objects of that class;
 * - a Python exception is handed to reticulate unchanged (`restore()`, called through
 *   reticulate, raises it again with its traceback), so that reticulate makes the same
 *   R error and py_last_error() as for its own call;
 * - an argument this file does not convert (anything but Python objects, NULL and plain
 *   scalars) sends the whole call to reticulate before Python is called.
 *
 * No Python headers are needed: the few functions of the C API used here are declared
 * below and resolved at run time in the libpython that reticulate loaded, so one build
 * serves any Python 3. Only the stable ABI's functions are used, and only through
 * pointers (no struct layouts but PyMethodDef's, part of the stable ABI).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RTLD_DEFAULT, RTLD_NOLOAD */
#endif
#include <dlfcn.h>
#include <string.h>
#include <time.h>

#include "crossing.h"
#include <R_ext/Rdynload.h>
#include <R_ext/Error.h>

typedef PyObject *(*PyCFunction)(PyObject *, PyObject *);
typedef struct {
  const char *ml_name;
  PyCFunction ml_meth;
  int ml_flags;
  const char *ml_doc;
} PyMethodDef;
#define METH_NOARGS 0x0004

pyapi py;
int crossing_ready = 0;
SEXP sym_pyobj, sym_convert, sym_py_object;



/* What init received or made: Python's None, the types a value result converts from,
 * the name "__class__", reticulate's py_call_impl(), take() and restore() as reticulate
 * objects (take with either `convert` flag). */
static PyObject *py_none, *empty_tuple, *type_float, *type_int, *type_bool, *type_none, *name_class;
static SEXP r_call_impl, r_ref_to_r, r_take[2], r_restore;
static SEXP r_pend, r_rethrow, r_callx_fallback, r_py_to_r, sym_update;

/* A Python exception waiting for restore(), and a result waiting for take(). */
static PyObject *err_type, *err_value, *err_tb, *taken;

/* The class vectors reticulate gave, by Python class (held, so that its address is not
 * reused by another class). */
#define CLASS_CACHE 64
static PyObject *cache_key[CLASS_CACHE];
static SEXP cache_class[CLASS_CACHE];
static int cache_n = 0;

/* Calls made and seconds spent in them, in Python (probes: crossing_stats()). */
static double calls_made = 0, seconds_in = 0;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double) t.tv_sec + 1e-9 * (double) t.tv_nsec;
}

static void finalize_ref(SEXP xp) {
  PyObject *o = (PyObject *) R_ExternalPtrAddr(xp);
  if (o == NULL || !crossing_ready || !py.IsInitialized()) return;
  PyGILState_STATE g = py.GILState_Ensure();
  py.DecRef(o);
  py.GILState_Release(g);
  R_ClearExternalPtr(xp);
}

void set_class(SEXP x, SEXP klass) {
  SEXP a = PROTECT(Rf_cons(klass, R_NilValue));
  SET_TAG(a, R_ClassSymbol);
  SET_ATTRIB(x, a);
  SET_OBJECT(x, 1);
  UNPROTECT(1);
}

/* reticulate's form of a Python object (takes the reference `o`). */
static SEXP make_ref(PyObject *o, int convert, SEXP klass) {
  SEXP xp = PROTECT(R_MakeExternalPtr(o, R_NilValue, R_NilValue));
  R_RegisterCFinalizer(xp, finalize_ref);
  SEXP env = PROTECT(R_NewEnv(R_EmptyEnv, FALSE, 0));
  Rf_defineVar(sym_pyobj, xp, env);
  Rf_defineVar(sym_convert, Rf_ScalarLogical(convert), env);
  if (klass != R_NilValue) set_class(env, klass);
  UNPROTECT(2);
  return env;
}

static PyObject *restore(PyObject *self, PyObject *unused) {
  (void) self;
  (void) unused;
  if (err_type == NULL) {
    py.IncRef(py_none);
    return py_none;
  }
  py.Err_Restore(err_type, err_value, err_tb);
  err_type = err_value = err_tb = NULL;
  return NULL;
}

static PyObject *take(PyObject *self, PyObject *unused) {
  (void) self;
  (void) unused;
  PyObject *o = taken;
  taken = NULL;
  if (o == NULL) {
    py.IncRef(py_none);
    return py_none;
  }
  return o;
}

static PyMethodDef def_restore = {"restore", restore, METH_NOARGS,
                                  "Raise the exception ampkit's compiled call caught."};
static PyMethodDef def_take = {"take", take, METH_NOARGS,
                               "Return the result of ampkit's compiled call."};

PyObject *env_object(SEXP env, int *convert) {
  if (TYPEOF(env) != ENVSXP) return NULL;
  SEXP xp = Rf_findVarInFrame(env, sym_pyobj);
  if (TYPEOF(xp) != EXTPTRSXP) return NULL;
  if (convert != NULL) {
    SEXP c = Rf_findVarInFrame(env, sym_convert);
    if (c == R_UnboundValue) *convert = 1;
    else if (TYPEOF(c) == LGLSXP && XLENGTH(c) == 1 && LOGICAL(c)[0] != NA_LOGICAL)
      *convert = LOGICAL(c)[0];
    else return NULL;
  }
  return (PyObject *) R_ExternalPtrAddr(xp);
}

static int plain_ascii(SEXP s) {
  if (s == NA_STRING) return 0;
  for (const unsigned char *p = (const unsigned char *) CHAR(s); *p; p++)
    if (*p > 127) return 0;
  return 1;
}

/* Whether `x` is an argument converted here: a Python object (reticulate's object, or
 * anything carrying one in its `py_object` attribute), NULL, a length-one logical,
 * integer, double or ASCII string without attributes and not NA, or a list without
 * attributes of such values but lists (a Python list). Checked for all arguments before
 * the GIL is taken; `obj` (unless NULL) receives the Python object of a top-level one. */
static int convertible_in(SEXP x, int depth, PyObject **obj) {
  switch (TYPEOF(x)) {
  case VECSXP:
    if (ATTRIB(x) != R_NilValue) break;  /* a carrier: list() with `py_object` */
    if (depth > 0) return 0;
    for (R_xlen_t i = 0; i < XLENGTH(x); i++)
      if (!convertible_in(VECTOR_ELT(x, i), depth + 1, NULL)) return 0;
    return 1;
  case NILSXP: return 1;
  case ENVSXP: {
    PyObject *o = OBJECT(x) ? env_object(x, NULL) : NULL;
    if (obj != NULL) *obj = o;
    return o != NULL;
  }
  case LGLSXP:
    return ATTRIB(x) == R_NilValue && XLENGTH(x) == 1 && LOGICAL(x)[0] != NA_LOGICAL;
  case INTSXP:
    return ATTRIB(x) == R_NilValue && XLENGTH(x) == 1 && INTEGER(x)[0] != NA_INTEGER;
  case REALSXP:
    return ATTRIB(x) == R_NilValue && XLENGTH(x) == 1 && !ISNA(REAL(x)[0]);
  case STRSXP:
    return ATTRIB(x) == R_NilValue && XLENGTH(x) == 1 && plain_ascii(STRING_ELT(x, 0));
  default:
    break;
  }
  SEXP o = Rf_getAttrib(x, sym_py_object);
  PyObject *p = o != R_NilValue ? env_object(o, NULL) : NULL;
  if (obj != NULL) *obj = p;
  return p != NULL;
}

/* Whether `x` converts here; `*obj` receives its Python object when it is one (a
 * reticulate object or a carrier), else NULL. */
static int convertible(SEXP x, PyObject **obj) {
  *obj = NULL;
  return convertible_in(x, 0, obj);
}

/* A new reference, or NULL with a Python error (the GIL held); `x` passed convertible(),
 * which gave `obj`, its Python object if it is one (then taken as it is). */
static PyObject *to_python(SEXP x, PyObject *obj) {
  PyObject *o;
  if (obj != NULL) {
    py.IncRef(obj);
    return obj;
  }
  switch (TYPEOF(x)) {
  case VECSXP:
    if (ATTRIB(x) != R_NilValue) break;
    o = py.List_New(XLENGTH(x));
    for (R_xlen_t i = 0; o != NULL && i < XLENGTH(x); i++) {
      PyObject *a = to_python(VECTOR_ELT(x, i), NULL);
      if (a == NULL || py.List_SetItem(o, i, a) != 0) {  /* (steals `a`) */
        py.DecRef(o);
        o = NULL;
      }
    }
    return o;
  case NILSXP: py.IncRef(py_none); return py_none;
  case ENVSXP: o = env_object(x, NULL); py.IncRef(o); return o;
  case LGLSXP: return py.Bool_FromLong(LOGICAL(x)[0]);
  case INTSXP: return py.Long_FromLong(INTEGER(x)[0]);
  case REALSXP: return py.Float_FromDouble(REAL(x)[0]);
  case STRSXP: return py.Unicode_FromString(CHAR(STRING_ELT(x, 0)));
  default: break;
  }
  o = env_object(Rf_getAttrib(x, sym_py_object), NULL);
  py.IncRef(o);
  return o;
}

SEXP via_reticulate(SEXP f, SEXP args, SEXP kwargs) {
  SEXP call = PROTECT(Rf_lang4(r_call_impl, f, args, kwargs));
  SEXP res = Rf_eval(call, R_GlobalEnv);
  UNPROTECT(1);
  return res;
}

static int cache_find(PyObject *cls) {
  for (int i = 0; i < cache_n; i++)
    if (cache_key[i] == cls) return i;
  return -1;
}

/* A value result (None, float, bool, int within R's integers) read as a C value (the GIL
 * held); it becomes the R value reticulate's py_ref_to_r() gives for it. */
enum { NOT_VALUE, VALUE_NULL, VALUE_REAL, VALUE_LGL, VALUE_INT };
static int read_value(PyObject *res, PyObject *cls, double *real, int *integer) {
  int overflow = 0;
  long v;
  if (cls == type_none) return VALUE_NULL;
  if (cls == type_float) {
    *real = py.Float_AsDouble(res);
    return VALUE_REAL;
  }
  if (cls != type_bool && cls != type_int) return NOT_VALUE;
  v = py.Long_AsLongAndOverflow(res, &overflow);
  if (cls == type_bool) {
    *integer = v != 0;
    return VALUE_LGL;
  }
  if (overflow || v <= -2147483647L - 1L || v > 2147483647L) return NOT_VALUE;
  *integer = (int) v;
  return VALUE_INT;
}

static SEXP r_value(int kind, double real, int integer) {
  switch (kind) {
  case VALUE_REAL: return Rf_ScalarReal(real);
  case VALUE_LGL: return Rf_ScalarLogical(integer);
  case VALUE_INT: return Rf_ScalarInteger(integer);
  default: return R_NilValue;
  }
}

/* R's call f(x). */
SEXP eval_r(SEXP f, SEXP x) {
  PROTECT(x);
  SEXP call = PROTECT(Rf_lang2(f, x));
  SEXP res = Rf_eval(call, R_GlobalEnv);
  UNPROTECT(2);
  return res;
}

/* reticulate's py_ref_to_r(x), for a result that is not a plain value. */
static SEXP ref_to_r(SEXP x) { return eval_r(r_ref_to_r, x); }

/* A result as an R object of reticulate's form (takes `res` and `cls`). */
static SEXP wrap_result(PyObject *res, PyObject *cls, int at, int convert) {
  if (at >= 0) return make_ref(res, convert, cache_class[at]);
  /* A class not seen yet: reticulate wraps the result once (take(), a reference of its
   * own) to give its class vector, which is kept for the objects of this class. The
   * object returned is made here all the same, so that every result has the same form
   * (and the same R reference counts, which the release of dropped outputs reads). */
  PyGILState_STATE g = py.GILState_Ensure();
  py.IncRef(res);
  py.GILState_Release(g);
  taken = res;
  SEXP probe = PROTECT(via_reticulate(r_take[convert ? 1 : 0], R_NilValue, R_NilValue));
  SEXP klass = Rf_getAttrib(probe, R_ClassSymbol);
  if (TYPEOF(klass) != STRSXP) klass = R_NilValue;
  if (klass != R_NilValue) klass = Rf_duplicate(klass);
  PROTECT(klass);
  SEXP out = PROTECT(make_ref(res, convert, klass));
  g = py.GILState_Ensure();
  if (cls != NULL && cache_n < CLASS_CACHE && klass != R_NilValue && cache_find(cls) < 0) {
    R_PreserveObject(klass);
    MARK_NOT_MUTABLE(klass);
    cache_key[cache_n] = cls;
    cache_class[cache_n] = klass;
    cache_n++;
  } else if (cls != NULL) {
    py.DecRef(cls);
  }
  py.GILState_Release(g);
  UNPROTECT(3);
  return out;
}

static int add_arg(call_args *a, SEXP value, const char *name) {
  PyObject *obj;
  if (!convertible(value, &obj)) return 0;
  if (name == NULL) {
    if (a->npos == MAX_ARGS) return 0;
    a->pobj[a->npos] = obj;
    a->pos[a->npos++] = value;
  } else {
    if (a->nkw == MAX_ARGS || name[0] == '\0') return 0;
    for (const unsigned char *p = (const unsigned char *) name; *p; p++)
      if (*p > 127) return 0;
    a->kw[a->nkw] = value;
    a->kobj[a->nkw] = obj;
    a->name[a->nkw++] = name;
  }
  return 1;
}

int args_from_lists(call_args *a, SEXP args, SEXP kwargs) {
  a->npos = a->nkw = 0;
  if ((args != R_NilValue && TYPEOF(args) != VECSXP) || (kwargs != R_NilValue && TYPEOF(kwargs) != VECSXP))
    return 0;
  for (R_xlen_t i = 0; i < Rf_xlength(args); i++)
    if (!add_arg(a, VECTOR_ELT(args, i), NULL)) return 0;
  R_xlen_t nkw = Rf_xlength(kwargs);
  if (nkw == 0) return 1;
  SEXP names = Rf_getAttrib(kwargs, R_NamesSymbol);
  if (TYPEOF(names) != STRSXP) return 0;
  for (R_xlen_t i = 0; i < nkw; i++) {
    SEXP nm = STRING_ELT(names, i);
    if (nm == NA_STRING || !add_arg(a, VECTOR_ELT(kwargs, i), CHAR(nm))) return 0;
  }
  return 1;
}

int args_from_pairlist(call_args *a, SEXP list) {
  a->npos = a->nkw = 0;
  for (; list != R_NilValue; list = CDR(list)) {
    SEXP tag = TAG(list);
    const char *name = tag == R_NilValue ? NULL : CHAR(PRINTNAME(tag));
    if (name != NULL && name[0] == '\0') name = NULL;
    if (!add_arg(a, CAR(list), name)) return 0;
  }
  return 1;
}

/* Keep the Python exception raised for restore() (the GIL held). */
static void keep_exception(void) {
  if (err_type != NULL) {  /* one never raised again: drop it */
    py.DecRef(err_type);
    if (err_value != NULL) py.DecRef(err_value);
    if (err_tb != NULL) py.DecRef(err_tb);
  }
  py.Err_Fetch(&err_type, &err_value, &err_tb);
}

/* Reticulate's R error for the Python exception kept: as it is (`context` NULL), or as the
 * package's condition (R/conditions.R's py_rethrow(), as py_try(expr, context) makes it). */
static SEXP restore_body(void *data) {
  (void) data;
  return via_reticulate(r_restore, R_NilValue, R_NilValue);
}

static SEXP restore_handler(SEXP cond, void *data) {
  SEXP call = PROTECT(Rf_lang3(r_rethrow, cond, *(SEXP *) data));
  Rf_eval(call, R_GlobalEnv);  /* raises */
  UNPROTECT(1);
  return R_NilValue;
}

static SEXP raise_python_error(SEXP context) {
  if (context == R_NilValue) return via_reticulate(r_restore, R_NilValue, R_NilValue);
  return R_tryCatchError(restore_body, NULL, restore_handler, &context);
}

/* A result that R does not keep as an object: its R value (the GIL held). */
static int value_now(PyObject *res, PyObject *cls, int mode, int convert, double *real, int *integer) {
  if (mode == MODE_NOTHING) return VALUE_NULL;
  if (mode == MODE_VALUE && cls == type_none) return VALUE_NULL;
  if (mode == MODE_TO_R && convert) return read_value(res, cls, real, integer);
  return NOT_VALUE;
}

SEXP call_python(PyObject *before, PyObject *f, PyObject **first, int nfirst,
                 const call_args *a, int convert, SEXP context, int mode) {
  PyGILState_STATE g = py.GILState_Ensure();
  PyObject *tuple = NULL, *dict = NULL, *res = NULL, *cls = NULL;
  int built = 1, at = -1, kind = NOT_VALUE, integer = 0;
  double real = 0;
  if (before != NULL) {
    double t0 = now();
    res = py.Object_Call(before, empty_tuple, NULL);
    seconds_in += now() - t0;
    built = res != NULL;
    if (res != NULL) py.DecRef(res);
    res = NULL;
  }
  if (built) {
    tuple = py.Tuple_New(nfirst + a->npos);
    built = tuple != NULL;
  }
  for (int i = 0; i < nfirst; i++) {  /* (the tuple steals them; dropped if there is none) */
    if (built) built = py.Tuple_SetItem(tuple, i, first[i]) == 0;
    else py.DecRef(first[i]);
  }
  for (int i = 0; built && i < a->npos; i++) {
    PyObject *o = to_python(a->pos[i], a->pobj[i]);
    built = o != NULL && py.Tuple_SetItem(tuple, nfirst + i, o) == 0;
  }
  if (built && a->nkw) {
    dict = py.Dict_New();
    built = dict != NULL;
    for (int i = 0; built && i < a->nkw; i++) {
      PyObject *o = to_python(a->kw[i], a->kobj[i]);
      built = o != NULL && py.Dict_SetItemString(dict, a->name[i], o) == 0;
      if (o != NULL) py.DecRef(o);
    }
  }
  if (built) {
    double t0 = now();
    res = py.Object_Call(f, tuple, dict);
    seconds_in += now() - t0;
    calls_made++;
  }
  if (tuple != NULL) py.DecRef(tuple);
  if (dict != NULL) py.DecRef(dict);
  if (res == NULL) {
    keep_exception();
  } else {
    cls = py.Object_GetAttr(res, name_class);
    if (cls == NULL) {
      py.Err_Clear();
    } else {
      kind = value_now(res, cls, mode, convert, &real, &integer);
      if (py.Err_Occurred()) {
        py.Err_Clear();
        kind = NOT_VALUE;
      }
      if (kind == NOT_VALUE) at = cache_find(cls);
    }
    if (kind != NOT_VALUE) {
      py.DecRef(res);
      res = NULL;
    }
    if (cls != NULL && (kind != NOT_VALUE || at >= 0)) {
      py.DecRef(cls);
      cls = NULL;
    }
  }
  py.GILState_Release(g);

  if (kind != NOT_VALUE) return r_value(kind, real, integer);
  if (res == NULL) return raise_python_error(context);
  SEXP out = PROTECT(wrap_result(res, cls, at, convert));
  if (mode == MODE_TO_R) out = ref_to_r(out);
  else if (mode == MODE_VALUE && !Rf_inherits(out, "torch.Tensor")) out = eval_r(r_py_to_r, out);
  UNPROTECT(1);
  return out;
}

/* ampkit_call(f, args, kwargs): reticulate's py_call_impl(f, args, kwargs). */
SEXP ampkit_call(SEXP f, SEXP args, SEXP kwargs) {
  int convert = 1;
  call_args a;
  PyObject *fobj = crossing_ready ? env_object(f, &convert) : NULL;
  if (fobj == NULL || !args_from_lists(&a, args, kwargs)) return via_reticulate(f, args, kwargs);
  return call_python(NULL, fobj, NULL, 0, &a, convert, R_NilValue, MODE_REF);
}

/* The deferred scaler update (R/scaler.R), taken from .pend for this call: its Python
 * callable, or NULL. `*keep` receives its R object, for the caller to protect. */
PyObject *pending_update(SEXP *keep) {
  SEXP u = Rf_findVarInFrame(r_pend, sym_update);
  *keep = R_NilValue;
  if (u == R_UnboundValue || u == R_NilValue) return NULL;
  *keep = u;
  Rf_defineVar(sym_update, R_NilValue, r_pend);
  return env_object(Rf_getAttrib(u, sym_py_object), NULL);
}

/* .External(ampkit_callx, context, mode, f, ...): the hot path's call of a Python
 * callable, as py_try(<conversion>(.h$call(f, list(...), <keywords>)), context) makes it
 * (R/package.R py_call()), the deferred update first, with the arguments as R passed
 * them (no list holds them: R's reference counts see nothing of the call). `mode`: the
 * result as reticulate's object (0), as py_ref_to_r() makes it (1), as py_value() makes
 * it (2), or NULL (3). `context` NULL: a Python exception is reticulate's error as it is. */
SEXP ampkit_callx(SEXP args) {
  args = CDR(args);
  SEXP context = CAR(args);
  args = CDR(args);
  int mode = Rf_asInteger(CAR(args));
  args = CDR(args);
  return callx(context, mode, CAR(args), NULL, CDR(args));
}

SEXP callx(SEXP context, int mode, SEXP f, SEXP first, SEXP rest) {
  int convert = 1;
  call_args a;
  PyObject *fobj = crossing_ready ? env_object(f, &convert) : NULL;
  int ok = fobj != NULL && args_from_pairlist(&a, rest);
  if (ok && first != NULL) {  /* `first` before the others, with no pairlist made for it */
    PyObject *obj;
    ok = a.npos < MAX_ARGS && convertible(first, &obj);
    if (ok) {
      for (int i = a.npos; i > 0; i--) {
        a.pos[i] = a.pos[i - 1];
        a.pobj[i] = a.pobj[i - 1];
      }
      a.pos[0] = first;
      a.pobj[0] = obj;
      a.npos++;
    }
  }
  if (!ok) {
    /* callx_fallback(context, mode, f, list(...)): the R path, through reticulate */
    if (first != NULL) rest = Rf_cons(first, rest);
    PROTECT(rest);
    SEXP list = PROTECT(Rf_PairToVectorList(rest));
    SEXP m = PROTECT(Rf_ScalarInteger(mode));
    SEXP call = PROTECT(Rf_lang5(r_callx_fallback, context, m, f, list));
    SEXP res = Rf_eval(call, R_GlobalEnv);
    UNPROTECT(4);
    return res;
  }
  release_dropped();  /* module.c: the outputs R dropped, before this call (a backward pass) */
  SEXP keep;
  PyObject *before = pending_update(&keep);
  PROTECT(keep);
  SEXP res = call_python(before, fobj, NULL, 0, &a, convert, context, mode);
  UNPROTECT(1);
  return res;
}

/* ampkit_to_r(x): reticulate's py_ref_to_r(x); None, floats, bools and ints within R's
 * integers of a converting object read here. */
SEXP ampkit_to_r(SEXP x) {
  int convert = 0, kind = NOT_VALUE, integer = 0;
  double real = 0;
  PyObject *o = crossing_ready && OBJECT(x) ? env_object(x, &convert) : NULL;
  if (o == NULL || !convert) return ref_to_r(x);
  PyGILState_STATE g = py.GILState_Ensure();
  PyObject *cls = py.Object_GetAttr(o, name_class);
  if (cls == NULL) {
    py.Err_Clear();
  } else {
    kind = read_value(o, cls, &real, &integer);
    py.DecRef(cls);
    if (py.Err_Occurred()) {
      py.Err_Clear();
      kind = NOT_VALUE;
    }
  }
  py.GILState_Release(g);
  return kind == NOT_VALUE ? ref_to_r(x) : r_value(kind, real, integer);
}

static void *find(void *lib, const char *name) {
  void *p = lib != NULL ? dlsym(lib, name) : NULL;
  return p != NULL ? p : dlsym(RTLD_DEFAULT, name);
}

/* The reticulate object of a new Python object made here (take, restore). */
static SEXP own_ref(PyObject *o, int convert) {
  SEXP r = make_ref(o, convert, R_NilValue);
  R_PreserveObject(r);
  return r;
}

/* ampkit_init(libpython, objects): resolve the C API in the libpython reticulate loaded
 * (or in the process). `objects`: reticulate's None, reticulate's py_call_impl(),
 * py_ref_to_r() and py_to_r(), the package's .pend, its py_rethrow_or_stop() and
 * callx_fallback(), and an 8th, unused. Returns "" when ready, else what is missing. */
SEXP ampkit_init(SEXP libpython, SEXP objects) {
  if (TYPEOF(objects) != VECSXP || XLENGTH(objects) != 8) return Rf_mkString("bad arguments");
  SEXP none = VECTOR_ELT(objects, 0), call_impl = VECTOR_ELT(objects, 1),
       ref_to_r = VECTOR_ELT(objects, 2);
  if (crossing_ready) return Rf_mkString("");
  void *lib = NULL;
  if (TYPEOF(libpython) == STRSXP && XLENGTH(libpython) == 1 && STRING_ELT(libpython, 0) != NA_STRING)
    lib = dlopen(CHAR(STRING_ELT(libpython, 0)), RTLD_LAZY | RTLD_NOLOAD);
#define RESOLVE(field, name)                                          \
  do {                                                                \
    *(void **) (&py.field) = find(lib, name);                         \
    if (py.field == NULL) return Rf_mkString("Python's C API has no " name); \
  } while (0)
  RESOLVE(IsInitialized, "Py_IsInitialized");
  RESOLVE(GILState_Ensure, "PyGILState_Ensure");
  RESOLVE(GILState_Release, "PyGILState_Release");
  RESOLVE(IncRef, "Py_IncRef");
  RESOLVE(DecRef, "Py_DecRef");
  RESOLVE(Object_Call, "PyObject_Call");
  RESOLVE(Object_GetAttr, "PyObject_GetAttr");
  RESOLVE(Object_Type, "PyObject_Type");
  RESOLVE(Tuple_New, "PyTuple_New");
  RESOLVE(Tuple_SetItem, "PyTuple_SetItem");
  RESOLVE(List_New, "PyList_New");
  RESOLVE(List_SetItem, "PyList_SetItem");
  RESOLVE(Dict_New, "PyDict_New");
  RESOLVE(Dict_SetItemString, "PyDict_SetItemString");
  RESOLVE(Long_FromLong, "PyLong_FromLong");
  RESOLVE(Long_AsLongAndOverflow, "PyLong_AsLongAndOverflow");
  RESOLVE(Float_FromDouble, "PyFloat_FromDouble");
  RESOLVE(Float_AsDouble, "PyFloat_AsDouble");
  RESOLVE(Bool_FromLong, "PyBool_FromLong");
  RESOLVE(Unicode_FromString, "PyUnicode_FromString");
  RESOLVE(Unicode_InternFromString, "PyUnicode_InternFromString");
  RESOLVE(CFunction_NewEx, "PyCFunction_NewEx");
  RESOLVE(Err_Occurred, "PyErr_Occurred");
  RESOLVE(Err_Clear, "PyErr_Clear");
  RESOLVE(Err_Fetch, "PyErr_Fetch");
  RESOLVE(Err_Restore, "PyErr_Restore");
#undef RESOLVE
  if (!py.IsInitialized()) return Rf_mkString("Python is not initialized");
  py_none = env_object(none, NULL);
  if (py_none == NULL)  /* (reticulate 1.28's form: an environment holding `pyobj`) */
    return Rf_mkString("reticulate's objects are not of the form this package reads");
  if (!Rf_isFunction(call_impl) || !Rf_isFunction(ref_to_r) ||
      !Rf_isFunction(VECTOR_ELT(objects, 3)) || !Rf_isEnvironment(VECTOR_ELT(objects, 4)) ||
      !Rf_isFunction(VECTOR_ELT(objects, 5)) || !Rf_isFunction(VECTOR_ELT(objects, 6)))
    return Rf_mkString("bad arguments");

  PyGILState_STATE g = py.GILState_Ensure();
  py.IncRef(py_none);
  PyObject *f = py.Float_FromDouble(0.0), *i = py.Long_FromLong(0), *b = py.Bool_FromLong(0);
  type_float = py.Object_Type(f);
  type_int = py.Object_Type(i);
  type_bool = py.Object_Type(b);
  type_none = py.Object_Type(py_none);
  py.DecRef(f);
  py.DecRef(i);
  py.DecRef(b);
  name_class = py.Unicode_InternFromString("__class__");
  empty_tuple = py.Tuple_New(0);
  PyObject *t = py.CFunction_NewEx((void *) &def_take, NULL, NULL);
  PyObject *r = py.CFunction_NewEx((void *) &def_restore, NULL, NULL);
  int made = empty_tuple && type_float && type_int && type_bool && type_none && name_class && t && r;
  if (t != NULL) py.IncRef(t);  /* one reference for each of the two take objects */
  py.GILState_Release(g);
  if (!made) return Rf_mkString("could not make the helper objects");
  r_call_impl = call_impl;
  R_PreserveObject(r_call_impl);
  r_ref_to_r = ref_to_r;
  R_PreserveObject(r_ref_to_r);
  r_py_to_r = VECTOR_ELT(objects, 3);
  r_pend = VECTOR_ELT(objects, 4);
  r_rethrow = VECTOR_ELT(objects, 5);
  r_callx_fallback = VECTOR_ELT(objects, 6);
  R_PreserveObject(objects);
  sym_update = Rf_install("update");
  r_take[0] = own_ref(t, 0);
  r_take[1] = own_ref(t, 1);
  r_restore = own_ref(r, 1);
  crossing_ready = 1;
  return Rf_mkString("");
}

/* ampkit_crossing_stats(reset): the calls made into Python so far, the seconds spent in
 * them (in Python: conversions excluded) and the classes cached; `reset` TRUE starts the
 * counts again. */
SEXP ampkit_crossing_stats(SEXP reset) {
  SEXP out = Rf_allocVector(REALSXP, 3);
  REAL(out)[0] = calls_made;
  REAL(out)[1] = seconds_in;
  REAL(out)[2] = cache_n;
  if (Rf_asLogical(reset) == TRUE) calls_made = seconds_in = 0;
  return out;
}

static const R_CallMethodDef call_methods[] = {
  {"ampkit_call", (DL_FUNC) &ampkit_call, 3},
  {"ampkit_to_r", (DL_FUNC) &ampkit_to_r, 1},
  {"ampkit_init", (DL_FUNC) &ampkit_init, 2},
  {"ampkit_crossing_stats", (DL_FUNC) &ampkit_crossing_stats, 1},
  {"ampkit_release_setup", (DL_FUNC) &ampkit_release_setup, 3},
  {"ampkit_release_forget", (DL_FUNC) &ampkit_release_forget, 1},
  {"ampkit_release_collecting", (DL_FUNC) &ampkit_release_collecting, 1},
  {"ampkit_release_calibrated", (DL_FUNC) &ampkit_release_calibrated, 0},
  {"ampkit_release_counts", (DL_FUNC) &ampkit_release_counts, 0},
  {"ampkit_region_setup", (DL_FUNC) &ampkit_region_setup, 1},
  {"ampkit_scaled_loss", (DL_FUNC) &ampkit_scaled_loss, 3},
  {"ampkit_scaled_done", (DL_FUNC) &ampkit_scaled_done, 1},
  {"ampkit_scaler_setup", (DL_FUNC) &ampkit_scaler_setup, 1},
  {"ampkit_scale", (DL_FUNC) &ampkit_scale, 2},
  {"ampkit_backward_function", (DL_FUNC) &ampkit_backward_function, 1},
  {"ampkit_defer_update", (DL_FUNC) &ampkit_defer_update, 2},
  {"ampkit_compiled_methods", (DL_FUNC) &ampkit_compiled_methods, 2},
  {NULL, NULL, 0}
};

static const R_ExternalMethodDef external_methods[] = {
  {"ampkit_module", (DL_FUNC) &ampkit_module, -1},
  {"ampkit_callx", (DL_FUNC) &ampkit_callx, -1},
  {"ampkit_region", (DL_FUNC) &ampkit_region, -1},
  {"ampkit_region_code", (DL_FUNC) &ampkit_region_code, -1},
  {"ampkit_scaled_backward", (DL_FUNC) &ampkit_scaled_backward, -1},
  {"ampkit_scaler_step", (DL_FUNC) &ampkit_scaler_step, -1},
  {"ampkit_zero_grad", (DL_FUNC) &ampkit_zero_grad, -1},
  {NULL, NULL, 0}
};

void R_init_ampkit(DllInfo *dll) {
  R_registerRoutines(dll, NULL, call_methods, NULL, external_methods);
  R_useDynamicSymbols(dll, FALSE);
  sym_pyobj = Rf_install("pyobj");
  sym_convert = Rf_install("convert");
  sym_py_object = Rf_install("py_object");
}
