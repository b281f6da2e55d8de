/* What crossing.c and module.c share: the few functions of Python's C API the package
 * calls (declared here and resolved at run time: no Python headers), and the call. */
#ifndef AMPKIT_CROSSING_H
#define AMPKIT_CROSSING_H

#include <sys/types.h>

#define R_NO_REMAP
#include <R.h>
#include <Rinternals.h>

typedef struct _object PyObject;
typedef ssize_t Py_ssize_t;
typedef int PyGILState_STATE;

typedef struct {
  int (*IsInitialized)(void);
  PyGILState_STATE (*GILState_Ensure)(void);
  void (*GILState_Release)(PyGILState_STATE);
  void (*IncRef)(PyObject *);
  void (*DecRef)(PyObject *);
  PyObject *(*Object_Call)(PyObject *, PyObject *, PyObject *);
  PyObject *(*Object_GetAttr)(PyObject *, PyObject *);
  PyObject *(*Object_Type)(PyObject *);
  PyObject *(*Tuple_New)(Py_ssize_t);
  int (*Tuple_SetItem)(PyObject *, Py_ssize_t, PyObject *);
  PyObject *(*List_New)(Py_ssize_t);
  int (*List_SetItem)(PyObject *, Py_ssize_t, PyObject *);
  PyObject *(*Dict_New)(void);
  int (*Dict_SetItemString)(PyObject *, const char *, PyObject *);
  PyObject *(*Long_FromLong)(long);
  long (*Long_AsLongAndOverflow)(PyObject *, int *);
  PyObject *(*Float_FromDouble)(double);
  double (*Float_AsDouble)(PyObject *);
  PyObject *(*Bool_FromLong)(long);
  PyObject *(*Unicode_FromString)(const char *);
  PyObject *(*Unicode_InternFromString)(const char *);
  PyObject *(*CFunction_NewEx)(void *, PyObject *, PyObject *);
  PyObject *(*Err_Occurred)(void);
  void (*Err_Clear)(void);
  void (*Err_Fetch)(PyObject **, PyObject **, PyObject **);
  void (*Err_Restore)(PyObject *, PyObject *, PyObject *);
} pyapi;

extern pyapi py;
extern int crossing_ready;
extern SEXP sym_pyobj, sym_convert, sym_py_object;

/* The arguments of one call, as R values: positional, then keywords by name; with the
 * Python object of each that is one (`pobj`, `kobj`; NULL for the others), read once
 * when the argument is checked, not again when it is converted. */
#define MAX_ARGS 32
typedef struct {
  int npos, nkw;
  SEXP pos[MAX_ARGS], kw[MAX_ARGS];
  PyObject *pobj[MAX_ARGS], *kobj[MAX_ARGS];
  const char *name[MAX_ARGS];
} call_args;

/* The Python object of a reticulate object (an environment holding `pyobj`), or NULL;
 * `convert`, when given, receives its flag. */
PyObject *env_object(SEXP env, int *convert);

/* From a list of positional arguments and a named list of keywords (reticulate's
 * py_call_impl() arguments), or from a pairlist with tags (.External's): 1 when every
 * argument converts here, else 0 (the call then goes to reticulate). */
int args_from_lists(call_args *a, SEXP args, SEXP kwargs);
int args_from_pairlist(call_args *a, SEXP list);

/* f(*first, *a.pos, **a.kw), after `before()` when given (NULL: none), with the GIL
 * taken; then the result as `mode` says (MODE_REF: reticulate's object; MODE_TO_R:
 * py_ref_to_r() of it; MODE_VALUE: py_value() of it (R/package.R); MODE_NOTHING: NULL),
 * or reticulate's R error for the Python exception, as the package's condition with
 * `context` (a string) unless it is NULL. It takes the references `first`. */
enum { MODE_REF = 0, MODE_TO_R = 1, MODE_VALUE = 2, MODE_NOTHING = 3 };
SEXP call_python(PyObject *before, PyObject *f, PyObject **first, int nfirst,
                 const call_args *a, int convert, SEXP context, int mode);

/* The deferred scaler update (R/scaler.R), taken for this call: its Python callable or
 * NULL; `*keep` its R object, for the caller to protect. */
PyObject *pending_update(SEXP *keep);

/* R's call f(x). */
SEXP eval_r(SEXP f, SEXP x);

SEXP ampkit_callx(SEXP args);

/* ampkit_callx()'s call of `f` (a reticulate object) with `first` (unless NULL), then the
 * arguments of the pairlist `rest`. */
SEXP callx(SEXP context, int mode, SEXP f, SEXP first, SEXP rest);

/* R's call of reticulate's py_call_impl(f, args, kwargs). */
SEXP via_reticulate(SEXP f, SEXP args, SEXP kwargs);

/* module.c: the module call and the release of outputs R dropped. */
SEXP ampkit_module(SEXP args);
SEXP ampkit_release_setup(SEXP rel, SEXP sizes, SEXP fns);
SEXP ampkit_release_forget(SEXP calibrating);
SEXP ampkit_release_collecting(SEXP start);
SEXP ampkit_release_calibrated(void);
SEXP ampkit_release_counts(void);
/* Let go of the outputs R dropped that nothing else in R reaches, now (callx()). */
void release_dropped(void);

/* Give the new object `x` (no attributes yet) the class vector `klass`, shared and not
 * copied (setAttrib() copies a vector that is referenced; `klass` is marked not mutable,
 * so that changing one object's class copies it). */
void set_class(SEXP x, SEXP klass);

/* region.c, scaler.c */
SEXP ampkit_region(SEXP args);
SEXP ampkit_region_code(SEXP args);
SEXP ampkit_region_setup(SEXP fns);
SEXP ampkit_scaled_loss(SEXP scaler, SEXP loss, SEXP backward);
SEXP ampkit_scaled_done(SEXP x);
SEXP ampkit_scaler_setup(SEXP fns);
SEXP ampkit_scale(SEXP private_env, SEXP x);
SEXP ampkit_backward_function(SEXP x);
SEXP ampkit_scaled_backward(SEXP args);
SEXP ampkit_scaler_step(SEXP args);
SEXP ampkit_zero_grad(SEXP args);
SEXP ampkit_defer_update(SEXP private_env, SEXP pend);
SEXP ampkit_compiled_methods(SEXP self, SEXP methods);

#endif
