# The R side alone of the seed's AMP step: every call into Python replaced by a canned
# result (a tensor for module calls, None for the others), so what is timed is the
# package's R code per step and per line, without reticulate's crossing or Python's
# work: deterministic enough to compare two versions of the package on a busy machine,
# where end-to-end timings of the real step vary by 2x from run to run. The release of
# dropped outputs is off (a canned output is never dropped).
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<lib> OMP_NUM_THREADS=1 AMPKIT_REPO=<repo> \
#     Rscript benchmarks/r/step_rside.R [steps=20000]
library(ampkit)
stopifnot(ampkit_available())
steps <- as.integer(commandArgs(trailingOnly = TRUE)[1])
if (is.na(steps)) steps <- 20000L
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
ampkit:::use_crossing(FALSE)  # the R path: the compiled crossing would call Python past the canned results
h <- ampkit:::.h
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)
for (i in 1:20) step((i - 1L) %% 10L + 1L)  # real steps first: caches and lookups made

call_of <- function(code) ampkit:::py_fn(reticulate::py_eval(code, convert = FALSE))
none <- h$call(call_of("lambda: None"), list(), NULL)
tens <- h$call(call_of("lambda: __import__('torch').zeros(1)"), list(), NULL)
modules <- list(attr(net, "py_object"), attr(loss_fn, "py_object"), h$fn$call_releasing)
options(ampkit.release_outputs = FALSE)
slot <- if (is.null(h$call_raw)) "call" else "call_raw"  # the crossing (older versions: .h$call)
saved <- list(call = h[[slot]], to_r = h$to_r)
h[[slot]] <- function(f, args, kwargs) {
  for (m in modules) if (identical(f, m)) return(tens)
  none
}
h$to_r <- function(x) 0
cpu_us <- function(f, n) {
  for (i in 1:200) f()
  t <- system.time(for (i in seq_len(n)) f())
  (t[["user.self"]] + t[["sys.self"]]) / n * 1e6
}
x <- data[[1]]
y <- targets[[1]]
lines <- list(
  "with_autocast(device_type = \"cpu\", { })" = function() with_autocast(device_type = "cpu", NULL),
  "output <- net(x)" = function() net(x),
  "loss <- loss_fn(output, y)" = function() loss_fn(x, y),
  "scaler$scale(loss)$backward()" = function() scaler$scale(x)$backward(),
  "scaler$step(opt)" = function() scaler$step(opt),
  "scaler$update()" = function() scaler$update(),
  "opt$zero_grad()" = function() opt$zero_grad()
)
whole <- vapply(1:3, function(k) cpu_us(function() step(1L), steps), 0)
per <- vapply(lines, function(f) median(vapply(1:3, function(k) cpu_us(f, steps %/% 2L), 0)), 0)
h[[slot]] <- saved$call
h$to_r <- saved$to_r
cat(sprintf("R side of the seed's AMP step (Python calls canned), ampkit %s: %.1f us/step (CPU time; median of 3 x %d steps; runs: %s)\n",
            utils::packageVersion("ampkit"), median(whole), steps, paste(round(whole, 1), collapse = ", ")))
print(data.frame(line = names(per), r_side_us = round(unname(per), 1)), row.names = FALSE)
