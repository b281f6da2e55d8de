# The seed step's seven calls into Python as bare .External() crossings of the compiled
# crossing (no with_autocast(), module closures, R6 methods, scaled loss or `$` methods), and
# the whole step as one crossing (ampkit.r_bridge.amp_step): the probes' floors, sourced by
# step_layers.R and step_gc.R after small_step.R (which makes data, targets, net, loss_fn,
# opt and scaler). They read package internals (the compiled routines, the scaler's bound
# calls): a probe, not an API.
x_ <- ampkit:::.x
pend <- ampkit:::.pend
private <- get("private", envir = scaler$.__enclos_env__)
fn <- ampkit:::.h$fn
net_py <- attr(net, "py_object")
loss_py <- attr(loss_fn, "py_object")
zero_grad <- ampkit:::py_fn(ampkit:::.h$bound_zero_grad(opt))
bare_step <- function(i) {
  token <- .External(x_$callx, NULL, 1L, fn$enter_autocast, "cpu", NULL, TRUE, NULL, NULL)
  output <- .External(x_$module, net_py, data[[i]])
  loss <- .External(x_$module, loss_py, output, targets[[i]])
  .External(x_$callx, NULL, 3L, fn$exit_autocast, token)
  .External(x_$callx, NULL, 3L, private$hot$scale_backward, loss)
  .External(x_$callx, NULL, 2L, private$hot$step, opt)
  pend$update <- private$deferred  # scaler$update(), made in the next call
  .External(x_$callx, NULL, 1L, zero_grad)
}
amp_step <- ampkit:::py_fn(reticulate::import("ampkit.r_bridge")$amp_step)
opt_py <- reticulate::r_to_py(opt)
# (read once: `scaler$py` is an active binding, an R6 call and a deferred-update check
# each time, ~14K R instructions a step that are the probe's, not the crossing's)
scaler_py <- scaler$py
one_crossing <- function(i) {
  .External(x_$callx, NULL, 3L, amp_step, net_py, loss_py, opt_py, scaler_py, data[[i]], targets[[i]], "cpu")
}
