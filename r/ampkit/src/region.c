/* An autocast region's block, run in compiled code (R/autocast.R's run_region(), with the
 * compiled crossing): enter the region, evaluate the block as eval(expr, env) does, call
 * it if it is a function, leave the region, also after an error or any other jump out of
 * the block. A Python exception raised in the block becomes the package's condition
 * (region_error(), a calling handler, as withCallingHandlers() would call it); any other
 * condition passes untouched.
 *
 * .External(ampkit_region, expr, env, device_type, dtype, enabled, cache_enabled, policy)
 */
#include "crossing.h"

static PyObject *py_enter, *py_exit;
static SEXP r_region_error, r_enter_context, sym_expr, sym_env, sym_value, call_eval, call_value;

SEXP ampkit_region_setup(SEXP fns) {
  if (TYPEOF(fns) != VECSXP || XLENGTH(fns) != 3) Rf_error("ampkit_region_setup: bad arguments");
  py_enter = env_object(VECTOR_ELT(fns, 0), NULL);
  py_exit = env_object(VECTOR_ELT(fns, 1), NULL);
  r_region_error = VECTOR_ELT(fns, 2);
  if (py_enter == NULL || py_exit == NULL || !Rf_isFunction(r_region_error))
    Rf_error("ampkit_region_setup: bad arguments");
  R_PreserveObject(fns);  /* keeps the Python functions alive */
  sym_expr = Rf_install("expr");
  sym_env = Rf_install("env");
  sym_value = Rf_install("value");
  call_eval = Rf_lang3(Rf_install("eval"), sym_expr, sym_env);
  R_PreserveObject(call_eval);
  call_value = Rf_lang1(sym_value);
  R_PreserveObject(call_value);
  r_enter_context = Rf_mkString("with_autocast()");
  R_PreserveObject(r_enter_context);
  return R_NilValue;
}

typedef struct {
  SEXP expr, env, token, frame;
  int convert;
} region;

static SEXP block_handler(SEXP cond, void *data) {
  (void) data;
  SEXP call = PROTECT(Rf_lang2(r_region_error, cond));
  Rf_eval(call, R_GlobalEnv);  /* raises the package's condition for a Python exception */
  UNPROTECT(1);
  return R_NilValue;           /* any other error goes on */
}

/* The block's frame: `expr`, `env` and `value` bound (value NULL for now). */
static SEXP new_frame(SEXP expr, SEXP env) {
  SEXP frame = PROTECT(R_NewEnv(R_BaseEnv, FALSE, 3));
  Rf_defineVar(sym_value, R_NilValue, frame);
  Rf_defineVar(sym_expr, expr, frame);
  Rf_defineVar(sym_env, env, frame);
  UNPROTECT(1);
  return frame;
}

/* Unbind what the block's frame holds, however the block ended. The frame lives on as
 * garbage until R collects it, and a binding there to `env` (the caller's frame) counts
 * as a reference: R then keeps the caller's bindings counted when the caller returns,
 * so the module outputs bound there (`output <- net(x)`) never read as dropped and are
 * not let go (R/memory.R). Replacing bindings that exist allocates nothing, so this
 * also runs during a jump. */
static void clear_frame(SEXP frame) {
  Rf_defineVar(sym_expr, R_NilValue, frame);
  Rf_defineVar(sym_env, R_NilValue, frame);
  Rf_defineVar(sym_value, R_NilValue, frame);
}

/* R's `eval(expr, env)`, then `value()` when the value is a function, as run_region()
 * writes them (so that an error's call reads the same), in a frame of their own. */
static SEXP block(void *data) {
  region *r = (region *) data;
  SEXP value = Rf_eval(call_eval, r->frame);
  if (Rf_isFunction(value)) {
    Rf_defineVar(sym_value, value, r->frame);
    value = Rf_eval(call_value, r->frame);
  }
  return value;
}

static SEXP guarded_block(void *data) {
  return R_withCallingErrorHandler(block, data, block_handler, NULL);
}

static SEXP leave(region *r, SEXP context) {
  call_args a;
  a.npos = 1;
  a.nkw = 0;
  a.pos[0] = r->token;
  SEXP keep;
  PyObject *before = pending_update(&keep);
  PROTECT(keep);
  SEXP res = call_python(before, py_exit, NULL, 0, &a, r->convert, context, MODE_NOTHING);
  UNPROTECT(1);
  return res;
}

static SEXP leave_body(void *data) { return leave((region *) data, R_NilValue); }
static SEXP ignore(SEXP cond, void *data) {
  (void) cond;
  (void) data;
  return R_NilValue;
}

/* After a jump out of the block: leave the region, and nothing may jump from here. */
static void cleanup(void *data, Rboolean jump) {
  if (!jump) return;
  clear_frame(((region *) data)->frame);
  R_tryCatchError(leave_body, data, ignore, NULL);
}

SEXP ampkit_region(SEXP args) {
  args = CDR(args);
  region r;
  r.expr = CAR(args);
  args = CDR(args);
  r.env = CAR(args);
  args = CDR(args);  /* device_type, dtype, enabled, cache_enabled, policy */
  call_args a;
  if (py_enter == NULL || !Rf_isEnvironment(r.env) || !args_from_pairlist(&a, args))
    Rf_error("ampkit: the compiled region is not ready for these arguments");
  r.convert = 1;
  SEXP keep;
  PyObject *before = pending_update(&keep);
  PROTECT(keep);
  r.token = PROTECT(call_python(before, py_enter, NULL, 0, &a, 1, r_enter_context, MODE_TO_R));
  r.frame = PROTECT(new_frame(r.expr, r.env));
  SEXP cont = PROTECT(R_MakeUnwindCont());
  SEXP value = PROTECT(R_UnwindProtect(guarded_block, &r, cleanup, &r, cont));
  SETCAR(cont, R_NilValue);  /* R_UnwindProtect() keeps the value there: one R reference more */
  clear_frame(r.frame);
  leave(&r, R_NilValue);
  UNPROTECT(5);
  return value;
}
