#' One whole mixed-precision training step
#'
#' `amp_train_step()` wraps the core's `make_train_step()`: it returns a
#' function `step(inputs, targets)` that does what the hand-written AMP loop
#' does (zero the gradients, run `model` and `loss_fn` in an autocast region,
#' scale the loss, `backward()`, step through the scaler, update the scale)
#' and returns the loss tensor. On CUDA the core captures the step in a CUDA
#' graph where that is exact; elsewhere it runs eagerly.
#'
#' The arguments are checked when the step is made: a bad `dtype`, `enabled`
#' or `policy` raises here (the core builds the region once), not at the
#' first step.
#'
#' R holds only the returned loss, so the step leaves no large tensors to R's
#' garbage collector; an out-of-memory error in a step collects garbage and
#' runs the step once more (see [amp_gc()]); a second one raises a condition
#' of class `ampkit_out_of_memory`.
#'
#' @param model A torch module, called as `model(inputs)`.
#' @param loss_fn A loss module or function, called as `loss_fn(output, targets)`.
#' @param optimizer An optimizer over the model's parameters.
#' @param ... Must be empty.
#' @param scaler An [amp_grad_scaler()] or `NULL` (the core makes one:
#'   enabled for `float16`, disabled for `bfloat16`).
#' @param device_type,dtype,enabled,cache_enabled,policy The autocast region,
#'   as in [with_autocast()]. `device_type = NULL` takes the device of the
#'   model's parameters.
#' @param capture `"auto"`, `TRUE` or `FALSE`: whether to capture the step in
#'   a CUDA graph.
#' @param warmup Eager steps before the capture; `NULL`: 3, or 11 for a model
#'   that holds a `DistributedDataParallel` (as in the core).
#' @param compile `FALSE`: the model as given. `TRUE`: the step compiles
#'   the model and the loss together (`torch.compile` of one module whose
#'   forward is `loss_fn(model(inputs), targets)`, so the loss fuses into the
#'   model's kernels); a named list: the same with `torch.compile(..., ...)` and
#'   those arguments, such as `list(mode = "max-autotune-no-cudagraphs")`.
#'   The first step compiles (an eager warm-up step, never inside the
#'   capture). Modes that record CUDA graphs of their own
#'   (`"reduce-overhead"`, `"max-autotune"`) are refused where the step may
#'   capture. Where torch cannot compile the model the step raises one R
#'   warning and runs it uncompiled; `attr(step, "py")$compiled` says which
#'   runs.
#'
#' Whenever the step gives up on capturing (when it is made, or at a later
#' step: a capture that failed, a DDP model built on the default stream, a
#' batch of another shape), it raises one R warning of class
#' `ampkit_python_warning` that names the reason and the fix;
#' `capture = FALSE` runs eagerly without it.
#'
#' @return A function `step(inputs, targets)` of class `ampkit_train_step`;
#'   `inputs` and `targets` are tensors or lists of tensors. The Python
#'   `TrainStep` is in `attr(step, "py")`.
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_sequential(nn_linear(4, 8), nn_relu(), nn_linear(8, 1))
#'   opt <- optim_sgd(net$parameters, lr = 0.01)
#'   step <- amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu",
#'                          capture = FALSE)
#'   for (i in 1:3) loss <- step(torch_randn(16, 4), torch_randn(16, 1))
#'   loss$item()
#' }
amp_train_step <- function(model, loss_fn, optimizer, ..., scaler = NULL,
                           device_type = NULL, dtype = NULL, enabled = TRUE,
                           cache_enabled = NULL, policy = NULL,
                           capture = "auto", warmup = NULL, compile = FALSE) {
  if (...length()) {
    check_dots_empty_(..., .hint = "Name the options after `optimizer`, e.g. amp_train_step(model, loss_fn, optimizer, device_type = \"cuda\").")
  }
  check_class(model, "torch.nn.modules.module.Module", "model", "a torch module (nn_linear(), nn_sequential(), ...)")
  if (!is.function(loss_fn) && !inherits(loss_fn, "python.builtin.object")) {
    abort(sprintf("`loss_fn` must be a loss module or function, such as nn_mse_loss(), not %s.", describe(loss_fn)),
          class = "ampkit_bad_argument")
  }
  check_class(optimizer, "torch.optim.optimizer.Optimizer", "optimizer", "a torch optimizer (optim_sgd(), optim_adam(), ...)")
  if (!is.null(scaler) && !inherits(scaler, "ampkit_grad_scaler")) {
    abort(sprintf("`scaler` must be NULL or an amp_grad_scaler(), not %s.", describe(scaler)),
          class = "ampkit_bad_argument")
  }
  # NULL entries are left out: the core fills in device_type (from the parameters) and dtype.
  autocast <- list(device_type = if (!is.null(device_type)) as_device_type(device_type),
                   dtype = as_py_dtype(dtype), enabled = as_py_bool(enabled),
                   cache_enabled = as_py_bool(cache_enabled, null_ok = TRUE),
                   policy = load_py_policy(policy, "amp_train_step()"))
  autocast <- autocast[!vapply(autocast, is.null, logical(1))]
  if (inherits(scaler, "ampkit_grad_scaler")) scaler <- scaler$py
  if (!(identical(capture, "auto") || isTRUE(capture) || isFALSE(capture))) {
    abort(sprintf("`capture` must be \"auto\", TRUE or FALSE, not %s.", describe(capture)),
          class = "ampkit_bad_argument")
  }
  if (!is.null(warmup)) {
    warmup <- as_py_int(warmup)
    if (warmup < 0L) {
      abort(sprintf("`warmup` must be a whole number >= 0 or NULL, not %s.", describe(warmup)),
            class = "ampkit_bad_argument")
    }
  }
  compile <- as_py_compile(compile)
  py_ready()
  # The region is built (and dropped) now, so that a bad dtype or policy fails here.
  py_try(do.call(.h$check_autocast, c(list(model), autocast)), "amp_train_step()")
  # A warning while the step is made (it cannot capture here) is an R warning now; a later
  # one (a capture given up at some step) is handed to R by the step's on_warning and
  # raised when that step returns: no per-step cost.
  py <- py_call_warn(py_ampkit$make_train_step, list(model, loss_fn, optimizer, scaler = scaler,
                                                     autocast = autocast, capture = capture,
                                                     warmup = warmup, compile = compile),
                      "amp_train_step()")
  pending <- character()
  py$on_warning <- function(message) {
    pending <<- c(pending, message)
    NULL
  }
  call <- py[["__call__"]]
  retry <- .h$retry_call
  step <- function(inputs, targets) {
    flush_update()  # a scaler's deferred update: the step reads its scale
    loss <- py_try(retry(call, inputs, targets), "amp_train_step")
    if (length(pending)) {
      messages <- pending
      pending <<- character()
      for (msg in messages) {
        warning(structure(class = c("ampkit_python_warning", "warning", "condition"),
                          list(message = paste0("amp_train_step: ", msg), call = NULL)))
      }
    }
    loss
  }
  structure(step, class = c("ampkit_train_step", "function"), py = py)
}

#' @export
print.ampkit_train_step <- function(x, ...) {
  cat("<ampkit_train_step> ", reticulate::py_repr(attr(x, "py")), "\n", sep = "")
  invisible(x)
}
