#' fp8 auto: calibrate which modules of a model run in fp8
#'
#' `amp_calibrate_fp8()` wraps the core's `calibrate_fp8()`. It runs
#' `model(example_inputs)` once, keeps each `nn_linear()`'s inputs, and for
#' each of those modules times `linear` in fp8 against the region dtype at
#' those shapes and measures the relative error of its output,
#' `||fp8 - ref|| / ||ref||`. A module gets fp8 when fp8 is more than
#' `min_speedup` times as fast and its error is at most `max_error`. The
#' result is an ordinary policy: the base policy with an fp8 module scope for
#' each such module (see [amp_scope()]). On the CPU, fp8 is an emulation,
#' always slower, so no module gets fp8 there. docs/autocast.md ("fp8 auto")
#' gives the whole algorithm.
#'
#' @param model A torch module.
#' @param example_inputs A tensor or a list of tensors: `model(example_inputs)`.
#' @param ... Must be empty.
#' @param policy The base policy: a name, a path or an [amp_policy()].
#' @param device_type `"cpu"` or `"cuda"`; `NULL`: the device of the
#'   model's parameters.
#' @param dtype The region dtype; `NULL`: the policy's for the device.
#' @param recipe `NULL` (the policy's fp8 recipe) or a named list of recipe
#'   keys, such as `list(scaling = "rowwise")`.
#' @param max_error The largest relative output error fp8 may have (> 0).
#' @param min_speedup fp8 must be more than this many times as fast (> 0).
#' @param backward `TRUE`: time forward and backward; `FALSE`: the forward.
#' @param warmup,repeats Calls before timing, and timed calls (the median
#'   counts).
#' @param timer `NULL` (the wall clock) or a function
#'   `function(module, precision, run)` returning milliseconds, where
#'   `precision` is `"fp8"` or the region dtype's name and `run()` runs the
#'   module's calls once.
#' @param x An `amp_calibrate_fp8()` result.
#' @return A list of class `ampkit_fp8_calibration`: `policy`, the
#'   [amp_policy()] to keep (with its module scopes); `region_policy`, the
#'   same without the scopes, for [with_autocast()] and [amp_train_step()]
#'   while [amp_apply_scopes()] has installed `policy`'s scopes on the model;
#'   `report`, a data.frame with one row per candidate module (`module`,
#'   `shapes`, `fp8_ms`, `ref_ms`, `speedup`, `error`, `precision`,
#'   `reason`).
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_sequential(nn_linear(16, 16), nn_relu(), nn_linear(16, 4))
#'   cal <- amp_calibrate_fp8(net, torch_randn(8, 16), device_type = "cpu", repeats = 2)
#'   cal$report[, c("module", "precision", "reason")]
#'   remove <- amp_apply_scopes(cal$policy, net)
#'   y <- with_autocast(net(torch_randn(8, 16)), device_type = "cpu", policy = cal$region_policy)
#'   remove()
#' }
amp_calibrate_fp8 <- function(model, example_inputs, ..., policy = "torch_default", device_type = NULL,
                              dtype = NULL, recipe = NULL, max_error = 0.1, min_speedup = 1,
                              backward = TRUE, warmup = 3, repeats = 10, timer = NULL) {
  if (...length()) {
    check_dots_empty_(..., .hint = "Name the options after `example_inputs`, e.g. amp_calibrate_fp8(net, x, max_error = 0.05).")
  }
  check_class(model, "torch.nn.modules.module.Module", "model", "a torch module (nn_linear(), nn_sequential(), ...)")
  if (inherits(example_inputs, "torch.Tensor")) {
    inputs <- reticulate::tuple(example_inputs)
  } else if (is_tensor_list(example_inputs)) {
    inputs <- reticulate::tuple(unname(example_inputs))
  } else {
    abort(sprintf("`example_inputs` must be a tensor or a list of tensors (the model's arguments), not %s.",
                  describe(example_inputs)), class = "ampkit_bad_argument")
  }
  positive <- function(x, arg) {
    x <- as_py_num(x, arg)
    if (!is.finite(x) || x <= 0) {
      abort(sprintf("`%s` must be a finite number > 0, not %s.", arg, describe(x)), class = "ampkit_bad_argument")
    }
    x
  }
  if (!is.null(recipe) && (!is.list(recipe) || (length(recipe) && (is.null(names(recipe)) || any(!nzchar(names(recipe))))))) {
    abort(sprintf("`recipe` must be NULL or a named list of fp8 recipe keys, such as list(scaling = \"rowwise\"), not %s.",
                  describe(recipe)), class = "ampkit_bad_argument")
  }
  if (!is.null(timer) && !is.function(timer)) {
    abort(sprintf("`timer` must be NULL or a function(module, precision, run) returning milliseconds, not %s.",
                  describe(timer)), class = "ampkit_bad_argument")
  }
  args <- list(model, inputs, policy = load_py_policy(policy, "amp_calibrate_fp8()"),
               device_type = if (!is.null(device_type)) as_device_type(device_type),
               dtype = as_py_dtype(dtype),
               recipe = if (!is.null(recipe)) do.call(reticulate::dict, recipe),
               max_error = positive(max_error, "max_error"), min_speedup = positive(min_speedup, "min_speedup"),
               backward = as_py_bool(backward), warmup = as_py_int(warmup, "warmup", min = 0),
               repeats = as_py_int(repeats, "repeats", min = 1), timer = timer)
  py_ready()
  py <- py_try(do.call(py_ampkit$calibrate_fp8, args), "amp_calibrate_fp8()")
  cols <- c("module", "shapes", "fp8_ms", "ref_ms", "speedup", "error", "precision", "reason")
  structure(list(policy = new_policy(py$policy), region_policy = new_policy(py$policy$without_modules()),
                 report = records_to_df(py$as_rows(), cols), py = py),
            class = "ampkit_fp8_calibration")
}

#' @rdname amp_calibrate_fp8
#' @export
print.ampkit_fp8_calibration <- function(x, ...) {
  cat(reticulate::py_str(x$py), "\n", sep = "")
  invisible(x)
}
