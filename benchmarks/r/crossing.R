# What each line of the seed's AMP step costs from R, through the compiled crossing and
# through reticulate (the package's fallback, ampkit:::use_crossing(FALSE)), against the
# same line in Python, in one process, interleaved. CPU time (user + system) per call;
# the 2-core VM is shared, so the minimum over the rounds is the steadier figure.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<lib> OMP_NUM_THREADS=1 AMPKIT_REPO=<repo> \
#     Rscript benchmarks/r/crossing.R [calls=3000] [repeats=5]
#
# Each line is timed alone, repeated on the same inputs (a region with an empty block,
# net(x), loss_fn(output, y), scaler$scale(loss)$backward() on a fresh loss, ...), so
# a line's figure is its R and crossing cost plus its own Python work, and R's extra is
# its figure less Python's.
library(ampkit)
stopifnot(ampkit_available())
args <- as.integer(commandArgs(trailingOnly = TRUE))
calls <- if (length(args) >= 1 && !is.na(args[[1]])) args[[1]] else 3000L
repeats <- if (length(args) >= 2 && !is.na(args[[2]])) args[[2]] else 5L
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
status <- ampkit:::crossing_status()
if (!status$on) stop("the compiled crossing is not in use: ", status$why)

source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)
epoch <- function(n) for (s in seq_len(n)) step((s - 1L) %% 10L + 1L)
py <- reticulate::py_run_string("
import time, torch, ampkit
from ampkit.r_bridge import amp_step
def py_lines(net, loss_fn, opt, scaler, data, targets, n):
    x, y = data[0], targets[0]
    output = net(x)
    def region():
        with ampkit.autocast('cpu'):
            pass
    def backward():
        scaler.scale(loss_fn(net(x), y)).backward()
    def step():
        scaler.step(opt)
        scaler.update()
    lines = [region, lambda: net(x), lambda: loss_fn(output, y), backward, lambda: loss_fn(net(x), y), step,
             opt.zero_grad, lambda: amp_step(net, loss_fn, opt, scaler, x, y, 'cpu')]
    out = []
    for f in lines:
        for _ in range(50):
            f()
        t = time.process_time()
        for _ in range(n):
            f()
        out.append((time.process_time() - t) / n * 1e6)
    return out
", convert = FALSE)
pyobj <- function(x) if (is.function(x)) attr(x, "py_object") else reticulate::r_to_py(x)
twin <- list(pyobj(net), pyobj(loss_fn), pyobj(opt), scaler$py, reticulate::r_to_py(data),
             reticulate::r_to_py(targets))

x <- data[[1]]
y <- targets[[1]]
output <- net(x)
lines <- list(
  "with_autocast(device_type = \"cpu\", { })" = function() with_autocast(device_type = "cpu", NULL),
  "output <- net(x)" = function() net(x),
  "loss <- loss_fn(output, y)" = function() loss_fn(output, y),
  "scaler$scale(loss)$backward()" = function() scaler$scale(loss_fn(net(x), y))$backward(),
  "  (loss_fn(net(x), y), the line's input)" = function() loss_fn(net(x), y),
  "scaler$step(opt); scaler$update()" = function() {
    scaler$step(opt)
    scaler$update()  # deferred to the next crossing: the next step(), in one call
  },
  "opt$zero_grad()" = function() opt$zero_grad(),
  "the whole step" = function() step(1L)
)
# CPU us per call; with the compiled crossing also the wall us per call spent in Python
# (its own clock), so that R's side of a line (the rest) shows apart from Python's work.
cpu_us <- function(f, n) {
  gc()
  ampkit:::crossing_status(reset = TRUE)
  t <- system.time(for (i in seq_len(n)) f())
  inside <- ampkit:::crossing_status(reset = TRUE)$seconds_in_python
  c((t[["user.self"]] + t[["sys.self"]]) / n * 1e6, inside / n * 1e6)
}
res <- list()
for (r in seq_len(repeats)) {
  for (mode in c("compiled", "reticulate")) {
    ampkit:::use_crossing(mode == "compiled")
    epoch(50L)  # warm
    for (name in names(lines)) {
      got <- cpu_us(lines[[name]], calls)
      res[[mode]][[name]] <- c(res[[mode]][[name]], got[[1]])
      if (mode == "compiled") res$inside[[name]] <- c(res$inside[[name]], got[[2]])
    }
  }
  ampkit:::use_crossing(TRUE)
  got <- reticulate::py_to_r(do.call(py$py_lines, c(twin, list(as.integer(calls)))))
  for (k in seq_along(lines)) res$python[[names(lines)[[k]]]] <- c(res$python[[names(lines)[[k]]]], got[[k]])
}
ampkit:::use_crossing(TRUE)
keep <- names(lines)
stat <- function(mode, f) round(vapply(keep, function(n) f(res[[mode]][[n]]), 0), 1)
tab <- data.frame(line = keep,
                  python = stat("python", stats::median),
                  r_compiled = stat("compiled", stats::median),
                  r_reticulate = stat("reticulate", stats::median),
                  python_min = stat("python", min),
                  r_compiled_min = stat("compiled", min),
                  r_reticulate_min = stat("reticulate", min))
tab$extra_compiled <- tab$r_compiled_min - tab$python_min
tab$extra_reticulate <- tab$r_reticulate_min - tab$python_min
tab$compiled_outside <- round(vapply(keep, function(n) stats::median(res$compiled[[n]] - res$inside[[n]]), 0), 1)
cat(sprintf("CPU us per call (median and min of %d rounds of %d calls, torch on one thread), Python's line and R's (compiled crossing, reticulate); extra: R min - Python min; compiled_outside: R's line less the time its crossings spent in Python (median). ampkit %s, reticulate %s\n",
            repeats, calls, utils::packageVersion("ampkit"), utils::packageVersion("reticulate")))
print(tab, row.names = FALSE)
