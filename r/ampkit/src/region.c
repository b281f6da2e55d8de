/* An autocast region's block, run in compiled code (R/autocast.R's run_region(), with the
 * compiled crossing): enter the region, evaluate the block as eval(expr, env) does, call
 * it if it is a function, leave the region, also after an error or any other jump out of
 * the block. A Python exception raised in the block becomes the package's condition
 * (region_error(), a calling handler, as withCallingHandlers() would call it); any other
 * condition passes untouched.
 *
 * .External(ampkit_region, expr, env, device_type, dtype, enabled, cache_enabled, policy)
 */
#include <string.h>

#include "crossing.h"

static PyObject *py_enter, *py_exit;
static SEXP r_region_error, r_region_options, r_force_code, r_enter_context, sym_expr, sym_env,
    sym_value, sym_code, sym_eval, call_eval, call_value;

SEXP ampkit_region_setup(SEXP fns) {
  if (TYPEOF(fns) != VECSXP || XLENGTH(fns) != 5) Rf_error("ampkit_region_setup: bad arguments");
  py_enter = env_object(VECTOR_ELT(fns, 0), NULL);
  py_exit = env_object(VECTOR_ELT(fns, 1), NULL);
  r_region_error = VECTOR_ELT(fns, 2);
  r_region_options = VECTOR_ELT(fns, 3);
  r_force_code = VECTOR_ELT(fns, 4);
  if (py_enter == NULL || py_exit == NULL || !Rf_isFunction(r_region_error) ||
      !Rf_isFunction(r_region_options) || !Rf_isFunction(r_force_code))
    Rf_error("ampkit_region_setup: bad arguments");
  sym_code = Rf_install("code");
  sym_eval = Rf_install("eval");
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
  a.pobj[0] = NULL;
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

/* Enter, run the block of `frame`, leave: the value of the block. */
static SEXP run(region *r, const call_args *a) {
  r->convert = 1;
  SEXP keep;
  PyObject *before = pending_update(&keep);
  PROTECT(keep);
  r->token = PROTECT(call_python(before, py_enter, NULL, 0, a, 1, r_enter_context, MODE_TO_R));
  SEXP cont = PROTECT(R_MakeUnwindCont());
  SEXP value = PROTECT(R_UnwindProtect(guarded_block, r, cleanup, r, cont));
  SETCAR(cont, R_NilValue);  /* R_UnwindProtect() keeps the value there: one R reference more */
  clear_frame(r->frame);
  leave(r, R_NilValue);
  UNPROTECT(4);
  return value;
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
  r.frame = PROTECT(new_frame(r.expr, r.env));
  SEXP value = run(&r, &a);
  UNPROTECT(1);
  return value;
}

/* Whether the region's options are as run_region() passes them on unchanged: a device
 * type, no dtype or a torch dtype, `enabled` TRUE, no cache option, no policy. */
static int plain_options(SEXP opts) {
  SEXP device = CAR(opts), dtype = CADR(opts), enabled = CADDR(opts);
  if (TYPEOF(device) != STRSXP || XLENGTH(device) != 1 || ATTRIB(device) != R_NilValue ||
      STRING_ELT(device, 0) == NA_STRING)
    return 0;
  const char *d = CHAR(STRING_ELT(device, 0));
  if (strcmp(d, "cpu") != 0 && strcmp(d, "cuda") != 0) return 0;
  if (dtype != R_NilValue && !(OBJECT(dtype) && Rf_inherits(dtype, "torch.dtype"))) return 0;
  if (TYPEOF(enabled) != LGLSXP || XLENGTH(enabled) != 1 || ATTRIB(enabled) != R_NilValue ||
      LOGICAL(enabled)[0] != TRUE)
    return 0;
  return CADDDR(opts) == R_NilValue && CAD4R(opts) == R_NilValue;
}

/* .External(ampkit_region_code, frame, device_type, dtype, enabled, cache_enabled, policy):
 * with_autocast()'s common call, from its frame: the options checked (and converted by
 * R/autocast.R's region_options() unless they are plain), then the region around the
 * promise `code` of that frame. The block's frame binds `expr` to the promise and `eval`
 * to R/autocast.R's force_code(), so that `eval(expr, env)` forces it: the code runs as
 * its own byte code, in the caller's frame, under a call that reads as run_region()'s
 * (an R error raised in the block has the same call as there). */
SEXP ampkit_region_code(SEXP args) {
  args = CDR(args);
  SEXP rho = CAR(args), opts = CDR(args);
  if (py_enter == NULL || !Rf_isEnvironment(rho))
    Rf_error("ampkit: the compiled region is not ready for these arguments");
  if (!plain_options(opts)) {  /* (as one list: the values are not evaluated again) */
    SEXP list = PROTECT(Rf_PairToVectorList(opts));
    SEXP call = PROTECT(Rf_lang2(r_region_options, list));
    opts = Rf_eval(call, rho);
    UNPROTECT(2);
  }
  PROTECT(opts);
  call_args a;
  if (!args_from_pairlist(&a, opts)) Rf_error("ampkit: the compiled region is not ready for these arguments");
  region r;
  r.expr = Rf_findVarInFrame(rho, sym_code);
  r.env = R_NilValue;
  r.frame = PROTECT(new_frame(r.expr, r.env));
  Rf_defineVar(sym_eval, r_force_code, r.frame);
  SEXP value = run(&r, &a);
  UNPROTECT(2);
  return value;
}
