/* The scaler's per-step R side with the compiled crossing (R/scaler.R): the scaled loss
 * that `scaler$scale(loss)` returns, made in one call, and `$update()` deferred to the
 * next call into Python (the rule is R/scaler.R's; this only makes it cheap). */
#include <string.h>

#include "crossing.h"

static SEXP sym_scaler, sym_loss, sym_backward, sym_stepped, sym_deferred, sym_update, sym_option,
    klass;
/* setup: R/scaler.R's scaled_tensor(), memory.R's watch_memory() and .mem, the routine of
 * a scaled loss's `$backward()`, and what its functions are made of. */
static SEXP r_scaled_tensor, r_watch_memory, r_mem, backward_routine, backward_formals, fn_invisible,
    fn_external, ctx_backward, ctx_step, ctx_zero_grad;
static SEXP sym_pyobj_, sym_hot, sym_base;

/* ampkit_scaled_loss(scaler, loss, backward): R/scaler.R's scaled_loss(). */
SEXP ampkit_scaled_loss(SEXP scaler, SEXP loss, SEXP backward) {
  if (klass == NULL) {
    sym_scaler = Rf_install("scaler");
    sym_loss = Rf_install("loss");
    sym_backward = Rf_install("backward");
    klass = Rf_mkString("ampkit_scaled_loss");
    R_PreserveObject(klass);
    MARK_NOT_MUTABLE(klass);
  }
  /* Not hashed: three bindings are found as fast in a list, and a hashed table of three
   * is resized as the third is bound (defineVar() then cost ~600 instructions each). */
  SEXP x = PROTECT(R_NewEnv(R_EmptyEnv, FALSE, 3));
  Rf_defineVar(sym_scaler, scaler, x);
  Rf_defineVar(sym_loss, loss, x);
  Rf_defineVar(sym_backward, backward, x);
  set_class(x, klass);
  UNPROTECT(1);
  return x;
}

/* ampkit_scaler_setup(list(scaled_tensor, watch_memory, .mem, backward routine)). */
SEXP ampkit_scaler_setup(SEXP fns) {
  if (TYPEOF(fns) != VECSXP || XLENGTH(fns) != 4 || !Rf_isFunction(VECTOR_ELT(fns, 0)) ||
      !Rf_isFunction(VECTOR_ELT(fns, 1)) || !Rf_isEnvironment(VECTOR_ELT(fns, 2)))
    Rf_error("ampkit_scaler_setup: bad arguments");
  R_PreserveObject(fns);
  r_scaled_tensor = VECTOR_ELT(fns, 0);
  r_watch_memory = VECTOR_ELT(fns, 1);
  r_mem = VECTOR_ELT(fns, 2);
  backward_routine = VECTOR_ELT(fns, 3);
  backward_formals = Rf_cons(R_MissingArg, R_NilValue);
  SET_TAG(backward_formals, R_DotsSymbol);
  R_PreserveObject(backward_formals);
  fn_invisible = Rf_eval(Rf_install("invisible"), R_BaseEnv);
  fn_external = Rf_eval(Rf_install(".External"), R_BaseEnv);
  ctx_backward = Rf_mkString("$scale(loss)$backward()");
  R_PreserveObject(ctx_backward);
  ctx_step = Rf_mkString("$step()");
  R_PreserveObject(ctx_step);
  ctx_zero_grad = Rf_mkString("$zero_grad()");
  R_PreserveObject(ctx_zero_grad);
  sym_pyobj_ = Rf_install("pyobj");
  sym_hot = Rf_install("hot");
  sym_base = Rf_install("base");
  sym_stepped = Rf_install("stepped");
  sym_deferred = Rf_install("deferred");
  sym_update = Rf_install("update");
  sym_option = Rf_install("ampkit.defer_update");
  return R_NilValue;
}

static SEXP list_elt(SEXP list, const char *name) {
  SEXP names = Rf_getAttrib(list, R_NamesSymbol);
  if (TYPEOF(list) != VECSXP || TYPEOF(names) != STRSXP) return R_NilValue;
  for (R_xlen_t i = 0; i < XLENGTH(list); i++)
    if (strcmp(CHAR(STRING_ELT(names, i)), name) == 0) return VECTOR_ELT(list, i);
  return R_NilValue;
}

/* ampkit_scale(private, x): `scaler$scale(x)` for a tensor `x`, the scaler's fields read
 * from its private environment; NULL for anything else (R's path). */
SEXP ampkit_scale(SEXP private_env, SEXP x) {
  if (!OBJECT(x) || !Rf_inherits(x, "torch.Tensor")) return R_NilValue;
  SEXP pyobj = Rf_findVarInFrame(private_env, sym_pyobj_);
  SEXP hot = Rf_findVarInFrame(private_env, sym_hot);
  return ampkit_scaled_loss(pyobj, x, list_elt(hot, "scale_backward"));
}

/* ampkit_backward_function(x): the function `x$backward` of a scaled loss, made here:
 * function(...) invisible(.External(<ampkit_scaled_backward>, <x>, ...)) (R/scaler.R's
 * scaled_backward() is its R twin). */
SEXP ampkit_backward_function(SEXP x) {
  SEXP body = PROTECT(Rf_lcons(fn_external, Rf_cons(backward_routine, Rf_cons(x, Rf_cons(R_DotsSymbol, R_NilValue)))));
  body = PROTECT(Rf_lang2(fn_invisible, body));
  SEXP f = Rf_allocSExp(CLOSXP);
  SET_FORMALS(f, backward_formals);
  SET_BODY(f, body);
  SET_CLOENV(f, R_BaseEnv);
  UNPROTECT(2);
  return f;
}

/* .External(ampkit_scaled_backward, x, ...): `x$backward(...)` of a scaled loss: one
 * Python call (scale_backward), then, without arguments, the loss let go. */
SEXP ampkit_scaled_backward(SEXP args) {
  args = CDR(args);
  SEXP x = CAR(args), dots = CDR(args);
  if (!Rf_isEnvironment(x)) Rf_error("ampkit_scaled_backward: bad argument");
  SEXP loss = Rf_findVarInFrame(x, sym_loss);
  if (loss == R_NilValue || loss == R_UnboundValue) return eval_r(r_scaled_tensor, x);  /* the error: used already */
  callx(ctx_backward, MODE_NOTHING, Rf_findVarInFrame(x, sym_backward), loss, dots);
  if (dots == R_NilValue) Rf_defineVar(sym_loss, R_NilValue, x);
  return R_NilValue;
}

/* .External(ampkit_scaler_step, private, optimizer, ...): `scaler$step(optimizer, ...)`
 * for an optimizer: the bound step, then the scaler marked stepped. */
SEXP ampkit_scaler_step(SEXP args) {
  args = CDR(args);
  SEXP private_env = CAR(args), rest = CDR(args);
  SEXP res = PROTECT(callx(ctx_step, MODE_VALUE, list_elt(Rf_findVarInFrame(private_env, sym_hot), "step"),
                           NULL, rest));
  Rf_defineVar(sym_stepped, Rf_ScalarLogical(TRUE), private_env);
  UNPROTECT(1);
  return res;
}

/* .External(ampkit_zero_grad, bound, ...): `opt$zero_grad(...)`, then memory.R's garbage
 * watch on the bytes it returns, unless they are .mem$base (no growth). */
SEXP ampkit_zero_grad(SEXP args) {
  args = CDR(args);
  SEXP bytes = PROTECT(callx(ctx_zero_grad, MODE_TO_R, CAR(args), NULL, CDR(args)));
  SEXP base = Rf_findVarInFrame(r_mem, sym_base);
  if (TYPEOF(bytes) == REALSXP && XLENGTH(bytes) == 1 && TYPEOF(base) == REALSXP && XLENGTH(base) == 1 &&
      !ISNA(REAL(base)[0]) && !ISNA(REAL(bytes)[0]) && REAL(bytes)[0] == REAL(base)[0]) {
    UNPROTECT(1);
    return R_NilValue;
  }
  eval_r(r_watch_memory, bytes);
  UNPROTECT(1);
  return R_NilValue;
}

/* ampkit_scaled_done(x): `x$loss <- NULL` on a scaled loss, without `$<-`'s dispatch. */
SEXP ampkit_scaled_done(SEXP x) {
  if (!Rf_isEnvironment(x)) Rf_error("ampkit_scaled_done: bad argument");
  if (sym_loss == NULL) sym_loss = Rf_install("loss");
  Rf_defineVar(sym_loss, R_NilValue, x);
  return R_NilValue;
}

/* ampkit_defer_update(private, pend): `$update()` without a new scale, after `$step()`,
 * with options(ampkit.defer_update) on and no other update pending: record it in `pend`
 * for the next call into Python and return TRUE; else FALSE (R makes it). */
SEXP ampkit_defer_update(SEXP private_env, SEXP pend) {
  SEXP stepped = Rf_findVarInFrame(private_env, sym_stepped);
  if (TYPEOF(stepped) != LGLSXP || XLENGTH(stepped) != 1 || LOGICAL(stepped)[0] != TRUE)
    return Rf_ScalarLogical(FALSE);
  SEXP on = Rf_GetOption1(sym_option);
  if (on != R_NilValue && !(TYPEOF(on) == LGLSXP && XLENGTH(on) == 1 && LOGICAL(on)[0] == TRUE))
    return Rf_ScalarLogical(FALSE);
  SEXP pending = Rf_findVarInFrame(pend, sym_update);
  if (pending != R_UnboundValue && pending != R_NilValue) return Rf_ScalarLogical(FALSE);
  SEXP deferred = Rf_findVarInFrame(private_env, sym_deferred);
  if (deferred == R_UnboundValue) return Rf_ScalarLogical(FALSE);
  Rf_defineVar(sym_stepped, Rf_ScalarLogical(FALSE), private_env);
  Rf_defineVar(sym_update, deferred, pend);
  return Rf_ScalarLogical(TRUE);
}

/* ampkit_compiled_methods(self, methods): R6 gives each object's methods their
 * environment with `environment<-`, which drops their byte code, so they run in R's AST
 * interpreter (about twice the instructions). This puts back the compiled methods (the
 * class's own, as installed), with the same environment, in place of the named ones. */
SEXP ampkit_compiled_methods(SEXP self, SEXP methods) {
  SEXP names = Rf_getAttrib(methods, R_NamesSymbol);
  if (!Rf_isEnvironment(self) || TYPEOF(methods) != VECSXP || TYPEOF(names) != STRSXP)
    Rf_error("ampkit_compiled_methods: bad arguments");
  for (R_xlen_t i = 0; i < XLENGTH(methods); i++) {
    SEXP sym = Rf_installChar(STRING_ELT(names, i));
    SEXP now = Rf_findVarInFrame(self, sym), compiled = VECTOR_ELT(methods, i);
    if (TYPEOF(now) != CLOSXP || TYPEOF(compiled) != CLOSXP) continue;
    SEXP f = PROTECT(Rf_duplicate(compiled));
    SET_CLOENV(f, CLOENV(now));
    Rboolean locked = R_BindingIsLocked(sym, self);
    if (locked) R_unLockBinding(sym, self);
    Rf_defineVar(sym, f, self);
    if (locked) R_LockBinding(sym, self);
    UNPROTECT(1);
  }
  return R_NilValue;
}
