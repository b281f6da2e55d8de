#' Gradient scaler (loss scaling) for mixed-precision training
#'
#' A gradient scaler multiplies the loss by a scale factor before
#' `backward()`, so that small gradients survive in `float16`, and divides the
#' gradients by it again before the optimizer steps. Steps whose gradients
#' hold `Inf` or `NaN` are skipped and the scale backs off; after
#' `growth_interval` clean steps it grows again. The state machine is the
#' ampkit Python core's `GradScaler`.
#'
#' `cuda_amp_grad_scaler(...)` is `amp_grad_scaler(device = "cuda", ...)`,
#' under the name R torch uses: it takes the same arguments (but `device`) with
#' the same defaults.
#'
#' The returned object has these methods:
#' \describe{
#'   \item{`$scale(x)`}{`x` times the scale. For a tensor it returns a scaled
#'     loss of class `ampkit_scaled_loss` whose `$backward()` scales and
#'     runs the backward pass in one call to Python, so that
#'     `scaler$scale(loss)$backward()` leaves no scaled tensor behind in R;
#'     any other use (`$item()`, `$dtype`, passing it to a Python function,
#'     printing) makes the scaled tensor. For a list of tensors it returns the
#'     list of scaled tensors.}
#'   \item{`$step(optimizer)`}{Unscales the gradients (unless `$unscale_()`
#'     did) and steps the optimizer unless they hold `Inf`/`NaN`.}
#'   \item{`$update(new_scale = NULL)`}{Updates the scale after a step;
#'     `new_scale` sets it instead. After `$step()`, the update is made at the
#'     start of ampkit's next call into Python, in the same call (in a training
#'     loop, `opt$zero_grad()`), which saves a call a step; every method of the
#'     scaler and `$py` make it first, so what they read is the updated state.
#'     Python code that holds the Python scaler from earlier (not through `$py`)
#'     sees the update once ampkit has made a call. `options(ampkit.defer_update =
#'     FALSE)` makes it at once. An update with `new_scale`, or without a step
#'     since the last update (an error), is made at once. Made at once, its
#'     Python call reads the CUDA memory allocated, and R's garbage is collected
#'     when it has grown past `ampkit.gc_threshold_mb` (see [amp_gc()]).}
#'   \item{`$unscale_(optimizer)`}{Divides the optimizer's gradients by the
#'     scale now (for gradient clipping before `$step()`).}
#'   \item{`$get_scale()`}{The current scale, an R number.}
#'   \item{`$is_enabled()`}{`TRUE` or `FALSE`.}
#'   \item{`$state_dict()`, `$load_state_dict(state)`}{Save and restore the
#'     state, as an R list.}
#'   \item{`$stats()`}{Counters kept by the core (steps, skipped steps, ...)
#'     as an R list.}
#'   \item{`$py`}{The Python `GradScaler` (read-only), after any deferred
#'     update.}
#' }
#' Misuse (a non-tensor to `$scale()`, `$step()` twice without `$update()`)
#' raises an R condition of class `ampkit_error`. An out-of-memory error in
#' `$scale(loss)$backward()`, `$step()` or `$update()` collects garbage and
#' runs the call once more (see [amp_gc()]); a second one raises a condition of
#' class `ampkit_out_of_memory`. A scaler for `"cuda"` on a
#' machine without CUDA is disabled by the core, with a warning of class
#' `ampkit_python_warning`.
#'
#' @param device `"cuda"` or `"cpu"`: where the scaled tensors live.
#' @param init_scale The initial scale.
#' @param growth_factor The factor (> 1) by which the scale grows.
#' @param backoff_factor The factor (in (0, 1)) by which the scale shrinks
#'   after a step with `Inf`/`NaN` gradients.
#' @param growth_interval How many clean steps in a row before the scale grows.
#' @param enabled `FALSE` makes every method a pass-through (`$scale(x)`
#'   returns `x`, `$step()` just steps), so one loop serves both cases.
#' @param ... For `amp_grad_scaler()`: further options of the Python
#'   `GradScaler`, by name: `hysteresis` (how many overflowing steps before the
#'   scale backs off), `min_scale`, `max_scale`. For `cuda_amp_grad_scaler()`:
#'   the arguments of `amp_grad_scaler()` after `device`.
#' @return An object of class `ampkit_grad_scaler` (an R6 object).
#' @seealso [with_autocast()], [amp_gc()]
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_linear(4, 1)
#'   opt <- optim_sgd(net$parameters, lr = 0.01)
#'   scaler <- amp_grad_scaler(device = "cpu", init_scale = 2^10)
#'   loss <- nn_mse_loss()(net(torch_randn(8, 4)), torch_randn(8, 1))
#'   scaler$scale(loss)$backward()
#'   scaler$step(opt)
#'   scaler$update()
#'   scaler$get_scale()
#'   scaler
#' }
amp_grad_scaler <- function(device = "cuda", init_scale = 2^16, growth_factor = 2,
                            backoff_factor = 0.5, growth_interval = 2000,
                            enabled = TRUE, ...) {
  device <- as_device_type(device, "device")
  init_scale <- as_py_num(init_scale)
  growth_factor <- as_py_num(growth_factor)
  backoff_factor <- as_py_num(backoff_factor)
  growth_interval <- as_py_int(growth_interval)
  enabled <- as_py_bool(enabled)
  extra <- scaler_options(...)
  py_ready()
  py <- py_call_warn(py_ampkit$GradScaler, c(list(
    device = device, init_scale = init_scale, growth_factor = growth_factor,
    backoff_factor = backoff_factor, growth_interval = growth_interval,
    enabled = enabled), extra), "amp_grad_scaler()")
  GradScalerR6$new(py)
}

#' @rdname amp_grad_scaler
#' @export
cuda_amp_grad_scaler <- function(...) {
  # The defaults live in amp_grad_scaler() alone; a `device` here would be
  # matched twice, so it gets the package's error instead of R's.
  if ("device" %in% names(list(...))) {
    abort("cuda_amp_grad_scaler() is for \"cuda\"; for another device use amp_grad_scaler(device = ...).",
          class = "ampkit_bad_argument")
  }
  amp_grad_scaler(device = "cuda", ...)
}

scaler_options <- function(..., hysteresis = NULL, min_scale = NULL, max_scale = NULL) {
  if (...length()) {
    abort(sprintf("Unknown argument(s) to amp_grad_scaler(): %s. Valid extra options are `hysteresis`, `min_scale` and `max_scale`.",
                  paste(names(list(...)), collapse = ", ")),
          class = "ampkit_bad_argument", call = sys.call(-1))
  }
  opts <- list()
  if (!is.null(hysteresis)) opts$hysteresis <- as_py_int(hysteresis)
  if (!is.null(min_scale)) opts$min_scale <- as_py_num(min_scale)
  if (!is.null(max_scale)) opts$max_scale <- as_py_num(max_scale)
  opts
}

# The bound Python methods are looked up once, in initialize(); each R method
# is then one Python call (plus a cheap R check).
#
# `$update()` after `$step()` (or `$unscale_()`) is deferred: it changes nothing but
# the scaler's own state, so it runs at the start of the package's next call into
# Python, in the same crossing (py_call(); in the seed's loop, `opt$zero_grad()`),
# which saves a crossing a step. Whatever reads the scaler's state goes through this
# object (its methods, `$py`) and runs the deferred update first (flush_update()).
# An update that would fail (no step since the last one) or sets `new_scale` runs at
# once, so its errors name `$update()` where it was called.
GradScalerR6 <- R6::R6Class("ampkit_grad_scaler",
  cloneable = FALSE,
  active = list(
    py = function(value) {
      if (!missing(value)) {
        abort("`$py` is read-only.", class = "ampkit_bad_argument", call = NULL)
      }
      flush_update()
      private$pyobj
    }
  ),
  public = list(
    initialize = function(py) {
      private$pyobj <- py
      f <- private$f
      # `update` is not among them: $update() goes through ScalerCalls.update,
      # which also reads the CUDA memory for the garbage watch.
      for (name in c("scale", "step", "unscale_", "get_scale",
                     "is_enabled", "state_dict", "load_state_dict", "stats")) {
        f[[name]] <- py[[name]]
      }
      private$f <- f
      # The per-step calls, bound to this scaler in Python (r_bridge.ScalerCalls).
      calls <- .h$ScalerCalls(py)
      private$hot <- lapply(list(scale_backward = "scale_backward", step = "step", update = "update"),
                            function(n) py_fn(calls[[n]]))
      private$deferred <- py_arg(calls[["update_deferred"]])
      # The per-step methods as byte code (R6 drops it: src/scaler.c says why).
      if (!is.null(.x$compiled_methods)) {
        .Call(.x$compiled_methods, self, GradScalerR6$public_methods[c("scale", "step", "update")])
      }
    },
    scale = function(x) {
      # (a tensor: the scaled loss, made in compiled code with the compiled crossing)
      if (.x$on && !is.null(scaled <- .Call(.x$scale, private, x))) return(scaled)
      if (inherits(x, "torch.Tensor")) return(scaled_loss(private$pyobj, x, private$hot$scale_backward))
      if (!is_tensor_list(x)) {
        abort(sprintf("`$scale()` takes a torch tensor (the loss) or a list of tensors, not %s.", describe(x)),
              class = "ampkit_bad_argument")
      }
      flush_update()
      py_try(private$f$scale(x), "$scale()")
    },
    step = function(optimizer, ...) {
      # (the compiled crossing makes the call and marks the scaler stepped: src/scaler.c;
      # oldClass() and any() are primitives, inherits() a closure)
      if (.x$on && any(oldClass(optimizer) == "torch.optim.optimizer.Optimizer")) {
        return(invisible(.External(.x$scaler_step, private, optimizer, ...)))
      }
      if (!inherits(optimizer, "torch.optim.optimizer.Optimizer")) {
        abort(sprintf("`$step()` takes a torch optimizer (from optim_sgd(), optim_adam(), ...), not %s.",
                      describe(optimizer)), class = "ampkit_bad_argument")
      }
      res <- if (.x$on) .External(.x$callx, "$step()", CALLX_VALUE, private$hot$step, optimizer, ...)
             else py_try(py_value(.h$call(private$hot$step, c(list(py_arg(optimizer)), dot_args(...)),
                                          dot_keywords(...))), "$step()")
      assign("stepped", TRUE, envir = private)
      invisible(res)
    },
    update = function(new_scale = NULL) {
      # (the compiled crossing makes the common case in one call: src/scaler.c)
      if (is.null(new_scale) && .x$on && .Call(.x$defer_update, private, .pend)) return(invisible(NULL))
      if (is.null(new_scale) && private$stepped && option_on("ampkit.defer_update")) {
        flush_update()  # another scaler's
        private$stepped <- FALSE
        .pend$update <- private$deferred
        return(invisible(NULL))
      }
      if (!is.null(new_scale) && !inherits(new_scale, "torch.Tensor")) {
        new_scale <- as_py_num(new_scale, "new_scale")
      }
      private$stepped <- FALSE
      watch_memory(if (.x$on) .External(.x$callx, "$update()", CALLX_TO_R, private$hot$update, new_scale)
                   else py_try(.h$to_r(.h$call(private$hot$update, list(py_arg(new_scale)), NULL)),
                               "$update()"))
    },
    unscale_ = function(optimizer) {
      flush_update()
      res <- py_try(private$f$unscale_(optimizer), "$unscale_()")
      private$stepped <- TRUE
      invisible(res)
    },
    get_scale = function() {
      flush_update()
      py_try(private$f$get_scale(), "$get_scale()")
    },
    is_enabled = function() py_try(private$f$is_enabled(), "$is_enabled()"),
    state_dict = function() {
      flush_update()
      st <- py_try(private$f$state_dict(), "$state_dict()")
      # The scale history is a Python list subclass (it prints as a summary there), which
      # reticulate leaves unconverted: made a plain list, it converts as every other list.
      h <- st[["_scale_history"]]
      if (inherits(h, "python.builtin.object")) st[["_scale_history"]] <- reticulate::import_builtins()$list(h)
      st
    },
    load_state_dict = function(state) {
      if (!is.list(state)) {
        abort(sprintf("`state` must be a list from `$state_dict()`, not %s.", describe(state)),
              class = "ampkit_bad_argument")
      }
      flush_update()
      private$stepped <- FALSE
      invisible(py_try(.h$load_scaler_state(private$pyobj, state), "$load_state_dict()"))
    },
    stats = function() {
      flush_update()
      .h$plain(py_try(private$f$stats(), "$stats()"))
    },
    print = function(...) {
      cat(format(self), sep = "\n")
      invisible(self)
    },
    format = function(...) {
      st <- tryCatch(self$state_dict(), error = function(e) list())
      enabled <- tryCatch(self$is_enabled(), error = function(e) NA)
      c("<ampkit_grad_scaler>",
        sprintf("  enabled: %s", enabled),
        sprintf("  scale: %s", format(tryCatch(self$get_scale(), error = function(e) NA))),
        vapply(setdiff(names(st), "scale"), function(n) {
          v <- st[[n]]
          sprintf("  %s: %s", n, if (is.atomic(v) && length(v) <= 1) format(v) else describe(v))
        }, ""))
    }
  ),
  # stepped: `$step()` or `$unscale_()` ran since the last `$update()` (so an update
  # can be deferred: it will find the checks it needs).
  private = list(pyobj = NULL, f = list(), hot = list(), deferred = NULL, stepped = FALSE)
)

# `scaler$scale(loss)`: the scaler and the loss, scaled when used. `$backward()`
# is one Python call (scale_backward); anything else makes the scaled tensor.
# An environment, so that `$backward()` can let go of the loss: R's reference count of
# the loss then drops, and the loss can be freed as a dropped output (memory.R).
scaled_loss <- function(scaler, loss, backward) {
  x <- new.env(parent = emptyenv(), size = 3L)
  x$scaler <- scaler
  x$loss <- loss
  x$backward <- backward
  class(x) <- "ampkit_scaled_loss"
  x
}

scaled_tensor <- function(x) {
  loss <- .subset2(x, "loss")
  if (is.null(loss)) {
    abort("This scaled loss was used by `$backward()` already; scale the loss again: scaler$scale(loss).",
          class = "ampkit_bad_argument", call = NULL)
  }
  flush_update()
  py_try(.subset2(x, "scaler")$scale(loss), "$scale()")
}

#' @export
`$.ampkit_scaled_loss` <- function(x, name) {
  # (with the compiled crossing, its compiled twin: src/scaler.c)
  if (name == "backward") return(if (.x$on) .Call(.x$backward_function, x) else scaled_backward(x))
  t <- scaled_tensor(x)
  `$`(t, name)
}

scaled_backward <- function(x) {
  force(x)
  function(...) {
    if (is.null(.subset2(x, "loss"))) scaled_tensor(x)  # the error: used already
    if (.x$on) {
      .External(.x$callx, "$scale(loss)$backward()", CALLX_NOTHING, .subset2(x, "backward"),
                .subset2(x, "loss"), ...)
    } else {
      py_try(.h$call(.subset2(x, "backward"), c(list(py_arg(.subset2(x, "loss"))), dot_args(...)),
                     dot_keywords(...)), "$scale(loss)$backward()")
    }
    # Without arguments (retain_graph and such) the graph is gone: let go of the loss.
    # (`x$loss <- NULL` dispatches `$<-` on the class; the compiled crossing unbinds it.)
    if (!...length()) {
      if (.x$on) .Call(.x$scaled_done, x) else x$loss <- NULL
    }
    invisible(NULL)
  }
}

#' @export
print.ampkit_scaled_loss <- function(x, ...) {
  print(scaled_tensor(x))
  invisible(x)
}

#' @exportS3Method reticulate::r_to_py
r_to_py.ampkit_scaled_loss <- function(x, convert = FALSE) scaled_tensor(x)
