# Where R's extra time on the seed's AMP step goes, by layer: the step as an R user writes
# it (small_step.R's step(i)); the same seven calls into Python made by bare .External()
# calls of the compiled crossing, with none of the package's R code around them (no
# with_autocast(), module closures, R6 methods, scaled loss, `$` methods); the whole step
# as one crossing (ampkit.r_bridge.amp_step); and Python's own loop of amp_step. In one
# process, interleaved, CPU time (user + system) per step.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<lib> OMP_NUM_THREADS=1 AMPKIT_REPO=<repo> \
#     Rscript benchmarks/r/step_layers.R [steps=2000] [rounds=5]
#
# step - bare: the package's R layer (and what running it between crossings costs Python);
# bare - one crossing: six crossings more; one crossing - Python: the floor of an R loop
# that crosses once a step. The rows "bare_<layer>" are the step as written with that one
# layer made bare (region: with_autocast(); modules: net() and loss_fn(); backward:
# scaler$scale(loss)$backward(); step_update: scaler$step(opt), scaler$update(); zero_grad:
# opt$zero_grad()): whether the R layer's cost is one layer's or spread over all of them.
# The bare calls read package internals (the compiled routines, the scaler's bound calls):
# this is a probe, not an API.
library(ampkit)
stopifnot(ampkit_available())
args <- as.integer(commandArgs(trailingOnly = TRUE))
steps <- if (length(args) >= 1 && !is.na(args[[1]])) args[[1]] else 2000L
rounds <- if (length(args) >= 2 && !is.na(args[[2]])) args[[2]] else 5L
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
status <- ampkit:::crossing_status()
if (!status$on) stop("the compiled crossing is not in use: ", status$why)
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)

source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "bare_step.R"))  # x_ ... bare_step(i), one_crossing(i)
# The step as written, but for one layer made bare.
bare_region <- function(i) {
  token <- .External(x_$callx, NULL, 1L, fn$enter_autocast, "cpu", NULL, TRUE, NULL, NULL)
  output <- net(data[[i]])
  loss <- loss_fn(output, targets[[i]])
  .External(x_$callx, NULL, 3L, fn$exit_autocast, token)
  scaler$scale(loss)$backward()
  scaler$step(opt)
  scaler$update()
  opt$zero_grad()
}
bare_modules <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- .External(x_$module, net_py, data[[i]])
    loss <- .External(x_$module, loss_py, output, targets[[i]])
  })
  scaler$scale(loss)$backward()
  scaler$step(opt)
  scaler$update()
  opt$zero_grad()
}
bare_backward <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- net(data[[i]])
    loss <- loss_fn(output, targets[[i]])
  })
  .External(x_$callx, NULL, 3L, private$hot$scale_backward, loss)
  scaler$step(opt)
  scaler$update()
  opt$zero_grad()
}
bare_step_update <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- net(data[[i]])
    loss <- loss_fn(output, targets[[i]])
  })
  scaler$scale(loss)$backward()
  .External(x_$callx, NULL, 2L, private$hot$step, opt)
  pend$update <- private$deferred
  opt$zero_grad()
}
bare_zero_grad <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- net(data[[i]])
    loss <- loss_fn(output, targets[[i]])
  })
  scaler$scale(loss)$backward()
  scaler$step(opt)
  scaler$update()
  .External(x_$callx, NULL, 1L, zero_grad)
}
py <- reticulate::py_run_string("
import time
from ampkit.r_bridge import amp_step
def py_loop(net, loss_fn, opt, scaler, data, targets, n):
    for s in range(100):
        amp_step(net, loss_fn, opt, scaler, data[s % 10], targets[s % 10], 'cpu')
    t = time.process_time()
    for s in range(n):
        amp_step(net, loss_fn, opt, scaler, data[s % 10], targets[s % 10], 'cpu')
    return (time.process_time() - t) / n * 1e6
", convert = FALSE)
twin <- list(net_py, loss_py, opt_py, scaler$py, reticulate::r_to_py(data), reticulate::r_to_py(targets))

# CPU us per step, and the wall-clock us a step spends inside Python's calls (the compiled
# crossing's own clock, crossing_status(); for "python", all of it): cpu - in_python is the
# R side (R's interpreter, the package's R code, the crossing's C code around each call).
cpu_us <- function(f, n) {
  for (s in 1:100) f((s - 1L) %% 10L + 1L)
  ampkit:::crossing_status(reset = TRUE)
  t <- system.time(for (s in seq_len(n)) f((s - 1L) %% 10L + 1L))
  c((t[["user.self"]] + t[["sys.self"]]) / n * 1e6, ampkit:::crossing_status()$seconds_in_python / n * 1e6)
}
loops <- list(step = step, bare = bare_step, one_crossing = one_crossing, bare_region = bare_region,
              bare_modules = bare_modules, bare_backward = bare_backward,
              bare_step_update = bare_step_update, bare_zero_grad = bare_zero_grad)
res <- list()
inside <- list()
for (r in seq_len(rounds)) {
  for (name in names(loops)) {
    m <- cpu_us(loops[[name]], steps)
    res[[name]] <- c(res[[name]], m[[1]])
    inside[[name]] <- c(inside[[name]], m[[2]])
  }
  res$python <- c(res$python, reticulate::py_to_r(do.call(py$py_loop, c(twin, list(as.integer(steps))))))
  inside$python <- res$python
}
tab <- data.frame(loop = names(res), median = round(vapply(res, stats::median, 0), 1),
                  min = round(vapply(res, min, 0), 1))
tab$min_vs_python <- round(tab$min / min(res$python), 2)
tab$in_python <- round(vapply(inside, stats::median, 0), 1)
tab$r_side <- round(vapply(names(res), function(k) stats::median(res[[k]] - inside[[k]]), 0), 1)
cat(sprintf("CPU us per step (median and min of %d rounds of %d steps, torch on one thread; in_python, r_side: medians). ampkit %s, reticulate %s\n",
            rounds, steps, utils::packageVersion("ampkit"), utils::packageVersion("reticulate")))
print(tab, row.names = FALSE)
