#' The numerics doctor: the first non-finite op, per-module statistics, a repair
#'
#' `amp_doctor()` arms the core's numerics doctor on a model. While armed it
#' checks every step on the device, without reading anything back, for an inf
#' or a NaN in the gradients (or the outputs), and names the first op
#' (forward or backward) that made one, with the module that ran it, by
#' replaying the first bad step when asked; every `every` steps it samples
#' per-module statistics:
#' absmax, the fraction of values cast to the low dtype that underflow to
#' zero, and the fraction of low-precision values beyond the dtype's range.
#' Disarmed (`$close()`), nothing of it is left installed.
#'
#' @param model A torch module (a Python module: `nn_linear()`,
#'   `nn_sequential()`, a module built by the core).
#' @param every Sample the statistics every `every` steps: a whole number
#'   `>= 1`. The first non-finite op is watched on every step.
#' @param ... Must be empty.
#' @param policy The cast policy the run uses (for `$suggest()`): `NULL` for
#'   `"torch_default"`, a name, a path or an [amp_policy()].
#' @param keep_weights `TRUE` to keep the weights each step began with, so that
#'   the replay of the first bad step runs that step's weights even when later
#'   steps changed them (one copy of them in memory, written only for the
#'   first bad step). `FALSE` (the default): the replay runs the weights of the time of
#'   reading; the finding's `weights` column says which.
#' @return An object of class `ampkit_doctor`, a list of functions:
#'   * `$first_nonfinite()`: `NULL`, or a one-row data.frame with columns
#'     `op`, `module`, `phase`, `dtype`, `step`, `input_absmax`,
#'     `output_absmax`, `weights` (`"step"` or `"current"`: the weights
#'     the replay ran), `verdict` (`""`: not judged, see `$findings()`);
#'   * `$findings(scaler)`: a data.frame, one row per bad step (the columns of
#'     `$first_nonfinite()`), its `verdict` column `"handled"` (a backward
#'     overflow the scaler skipped and could still back off from) or `"harmful"`
#'     (a forward one, one not skipped, one that recurs where the scaler cannot
#'     lower the scale); `scaler` is the [amp_grad_scaler()] of the run;
#'   * `$first_harmful(scaler)`: `NULL`, or the first harmful row of
#'     `$findings(scaler)`;
#'   * `$stats()`: a data.frame, one row per module and sampled step
#'     (`step`, `module`, `absmax`, `grad_absmax`, `underflow`, `overflow`,
#'     `cast_elements`, `low_elements`);
#'   * `$fp8_stats()`: a data.frame, one row per sampled step, module and
#'     operand an op of the policy's `fp8` category cast (`step`, `module`,
#'     `operand` (`"input"`, `"weight"`, `"grad_output"`), `dtype`, `ops`,
#'     `amax`, `overflow` (fraction of elements saturated), `underflow`
#'     (fraction of nonzero elements flushed to zero), `scale`, `elements`,
#'     `casts`); no rows when no op ran in fp8;
#'   * `$suggest(scaler = NULL, fp8_overflow = NULL, fp8_underflow = NULL)`: an
#'     [amp_policy()] with module scopes that stop what the doctor saw (write it
#'     with `$py$to_yaml()`); with the run's `scaler` it acts on the first
#'     harmful finding only; a module whose fp8 operands saturated or flushed
#'     more than the thresholds (`NULL`: the core's defaults, 0.001 and 0.01)
#'     moves back from fp8 to the region dtype;
#'   * `$heatmap(path)`: writes a PNG of per-module underflow and overflow
#'     over the sampled steps and returns `path`;
#'   * `$close()`: disarms the doctor.
#'   The Python doctor is in `$py`.
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_sequential(nn_linear(4, 4), nn_linear(4, 1))
#'   doc <- amp_doctor(net)
#'   with_autocast(device_type = "cpu", dtype = torch_float16(), {
#'     y <- net(torch_randn(2, 4))
#'   })
#'   doc$first_nonfinite()
#'   doc$close()
#' }
amp_doctor <- function(model, every = 100, ..., policy = NULL, keep_weights = FALSE) {
  if (...length()) {
    check_dots_empty_(..., .hint = "Name the options after `model`, e.g. amp_doctor(model, every = 10).")
  }
  check_class(model, "torch.nn.modules.module.Module", "model", "a torch module (nn_linear(), nn_sequential(), ...)")
  every <- as_py_int(every, "every", min = 1)
  if (!is.logical(keep_weights) || length(keep_weights) != 1 || is.na(keep_weights)) {
    abort(sprintf("`keep_weights` must be TRUE or FALSE, not %s.", describe(keep_weights)),
          class = "ampkit_bad_argument")
  }
  py_ready()
  pol <- if (inherits(policy, "ampkit_policy")) policy$py else policy
  doc <- py_try(py_ampkit$doctor(model, every = every, policy = pol, keep_weights = keep_weights), "amp_doctor()")
  structure(list(
    py = doc,
    first_nonfinite = function() {
      f <- py_try(doc$first_nonfinite(), "first_nonfinite()")
      if (is.null(f)) return(NULL)
      as.data.frame(f$to_dict(), stringsAsFactors = FALSE)
    },
    findings = function(scaler) {
      rows <- py_try(doc$findings(doctor_scaler(scaler)), "findings()")
      records_to_df(lapply(rows, function(f) f$to_dict()), finding_columns)
    },
    first_harmful = function(scaler) {
      f <- py_try(doc$first_harmful(doctor_scaler(scaler)), "first_harmful()")
      if (is.null(f)) return(NULL)
      as.data.frame(f$to_dict(), stringsAsFactors = FALSE)
    },
    stats = function() {
      rows <- py_try(doc$stats(), "stats()")
      records_to_df(rows, c("step", "module", "absmax", "grad_absmax", "underflow", "overflow",
                            "cast_elements", "low_elements"))
    },
    fp8_stats = function() {
      rows <- py_try(doc$fp8_stats(), "fp8_stats()")
      records_to_df(rows, fp8_columns)
    },
    suggest = function(scaler = NULL, fp8_overflow = NULL, fp8_underflow = NULL) {
      py_scaler <- if (is.null(scaler)) NULL else doctor_scaler(scaler)
      thresholds <- Filter(Negate(is.null), list(fp8_overflow = fp8_overflow, fp8_underflow = fp8_underflow))
      new_policy(py_try(do.call(doc$suggest, c(list(scaler = py_scaler), thresholds)), "suggest()"))
    },
    heatmap = function(path) {
      if (!is.character(path) || length(path) != 1 || is.na(path)) {
        abort(sprintf("`path` must be a file path (a string), not %s.", describe(path)),
              class = "ampkit_bad_argument")
      }
      py_try(doc$heatmap(path), "heatmap()")
      invisible(path)
    },
    close = function() invisible(py_try(doc$close(), "close()"))
  ), class = "ampkit_doctor")
}

fp8_columns <- c("step", "module", "operand", "dtype", "ops", "amax", "overflow", "underflow", "scale",
                 "elements", "casts")

finding_columns <- c("op", "module", "phase", "dtype", "step", "input_absmax", "output_absmax",
                     "weights", "verdict")

# The doctor judges findings by the run's scaler: an amp_grad_scaler(), whose Python
# scaler it reads (the rule itself is the core's).
doctor_scaler <- function(scaler) {
  if (!inherits(scaler, "ampkit_grad_scaler")) {
    abort(sprintf("`scaler` must be the amp_grad_scaler() that steps the model's optimizer, not %s.",
                  describe(scaler)),
          class = "ampkit_bad_argument", call = sys.call(-1))
  }
  scaler$py
}

#' @export
print.ampkit_doctor <- function(x, ...) {
  cat(reticulate::py_str(x$py), "\n", sep = "")
  invisible(x)
}

#' Rules per module: scope a policy to a model's modules
#'
#' `amp_scope()` adds a module scope to a policy: inside the modules whose
#' qualified names match the glob `scope` (`"head"`, `"blocks.*.attn"`; `*`
#' matches within one dotted part, `**` across parts) the scope pins the
#' module to `float32` or moves ops between categories. The innermost scoped
#' module wins. `amp_apply_scopes()` installs a policy's scopes on a model
#' (hooks on the matched modules only) and returns a function that removes
#' them. A glob that matches no module, or a module matched by two scopes
#' with different rules, is an error and installs nothing.
#'
#' @param policy An [amp_policy()].
#' @param scope A module glob.
#' @param ... Op moves by category, as in [amp_policy()]: `fp32 = "softmax"`.
#' @param pin `"float32"` to run the module with autocast off, or `NULL`.
#' @param model A torch module.
#' @return `amp_scope()`: a new [amp_policy()]. `amp_apply_scopes()`: a
#'   function of no arguments that removes the hooks (invisibly).
#'   `amp_scopes()`: a data.frame of the policy's scopes (`scope`, `pin`,
#'   `op`, `category`).
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_sequential(nn_linear(4, 4), nn_linear(4, 1))
#'   p <- amp_scope(amp_policy(), "1", pin = "float32")
#'   amp_scopes(p)
#'   remove <- amp_apply_scopes(p, net)
#'   with_autocast(device_type = "cpu", net(torch_randn(2, 4))$dtype)
#'   remove()
#' }
amp_scope <- function(policy, scope, ..., pin = NULL) {
  check_class(policy, "ampkit_policy", "policy", "an amp_policy()")
  if (!is.character(scope) || length(scope) != 1 || is.na(scope)) {
    abort(sprintf("`scope` must be a module glob (a string), not %s.", describe(scope)),
          class = "ampkit_bad_argument")
  }
  moves <- list(...)
  if (length(moves) && (is.null(names(moves)) || any(!nzchar(names(moves))))) {
    abort("Op moves in `...` must be named by category, e.g. amp_scope(p, \"head\", fp32 = \"linear\").",
          class = "ampkit_bad_argument")
  }
  moves <- Map(as_py_ops, moves, names(moves))
  new_policy(py_try(do.call(policy$py$with_module, c(list(scope, pin = pin), moves)), "amp_scope()"))
}

#' @rdname amp_scope
#' @export
amp_apply_scopes <- function(policy, model) {
  check_class(policy, "ampkit_policy", "policy", "an amp_policy()")
  check_class(model, "torch.nn.modules.module.Module", "model", "a torch module (nn_linear(), nn_sequential(), ...)")
  handle <- py_try(policy$py$apply(model), "amp_apply_scopes()")
  invisible(function() invisible(handle$remove()))
}

#' @rdname amp_scope
#' @export
amp_scopes <- function(policy) {
  check_class(policy, "ampkit_policy", "policy", "an amp_policy()")
  rows <- list()
  for (m in policy$py$modules) {
    d <- m$to_dict()
    if (!is.null(d$pin)) rows[[length(rows) + 1]] <- list(scope = m$pattern, pin = d$pin, op = NA_character_,
                                                          category = NA_character_)
    for (cat in setdiff(names(d), "pin")) {
      for (op in unlist(d[[cat]])) rows[[length(rows) + 1]] <- list(scope = m$pattern, pin = NA_character_,
                                                                    op = op, category = cat)
    }
  }
  records_to_df(rows, c("scope", "pin", "op", "category"))
}
