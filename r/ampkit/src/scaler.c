/* The scaler's per-step R side with the compiled crossing (R/scaler.R): the scaled loss
 * that `scaler$scale(loss)` returns, made in one call, and `$update()` deferred to the
 * next call into Python (the rule is R/scaler.R's; this only makes it cheap). */
#include "crossing.h"

static SEXP sym_scaler, sym_loss, sym_backward, sym_stepped, sym_deferred, sym_update, sym_option,
    klass;

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
  SEXP x = PROTECT(R_NewEnv(R_EmptyEnv, TRUE, 3));
  Rf_defineVar(sym_scaler, scaler, x);
  Rf_defineVar(sym_loss, loss, x);
  Rf_defineVar(sym_backward, backward, x);
  set_class(x, klass);
  UNPROTECT(1);
  return x;
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
  if (sym_stepped == NULL) {
    sym_stepped = Rf_install("stepped");
    sym_deferred = Rf_install("deferred");
    sym_update = Rf_install("update");
    sym_option = Rf_install("ampkit.defer_update");
  }
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
