# What each line of the seed's AMP step costs from R, through the compiled crossing and
# through reticulate (the package's fallback), in one process, interleaved; and the
# whole step against its Python twin. CPU time (user + system) per call, medians.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<lib> OMP_NUM_THREADS=1 \
#     Rscript r/ampkit/bench/crossing.R [calls=3000] [repeats=5]
#
# Each line is timed alone, repeated on the same inputs (a region with an empty block,
# net(x), loss_fn(output, y), scaler$scale(loss)$backward() on a fresh loss, ...), so
# a line's figure is its R and crossing cost plus its own Python work.
library(ampkit)
stopifnot(ampkit_available())
args <- as.integer(commandArgs(trailingOnly = TRUE))
calls <- if (length(args) >= 1 && !is.na(args[[1]])) args[[1]] else 3000L
repeats <- if (length(args) >= 2 && !is.na(args[[2]])) args[[2]] else 5L
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
status <- ampkit:::crossing_status()
if (!status$on) stop("the compiled crossing is not in use: ", status$why)

torch_manual_seed(1)
data <- lapply(1:10, function(i) torch_randn(8, 16))
targets <- lapply(1:10, function(i) torch_randn(8, 16))
net <- nn_sequential(nn_linear(16, 16), nn_relu(), nn_linear(16, 16), nn_relu(), nn_linear(16, 16))
loss_fn <- nn_mse_loss()
opt <- optim_sgd(net$parameters, lr = 0.1)
scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
step <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- net(data[[i]])
    loss <- loss_fn(output, targets[[i]])
  })
  scaler$scale(loss)$backward()
  scaler$step(opt)
  scaler$update()
  opt$zero_grad()
}
epoch <- function(n) for (s in seq_len(n)) step((s - 1L) %% 10L + 1L)
py <- reticulate::py_run_string("
import torch, ampkit
from ampkit.r_bridge import amp_step
def py_epoch(net, loss_fn, opt, scaler, data, targets, n):
    for s in range(n):
        amp_step(net, loss_fn, opt, scaler, data[s % 10], targets[s % 10], 'cpu')
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
  "scaler$scale(loss)$backward()" = function() scaler$scale(net(x)$sum())$backward(),
  "  (net(x)$sum(), the line's input)" = function() net(x)$sum(),
  "scaler$step(opt); scaler$update()" = function() {
    scaler$step(opt)
    scaler$update()  # deferred to the next crossing: the next step(), in one call
  },
  "opt$zero_grad()" = function() opt$zero_grad(),
  "the whole step" = function() step(1L)
)
cpu_us <- function(f, n) {
  gc()
  t <- system.time(for (i in seq_len(n)) f())
  (t[["user.self"]] + t[["sys.self"]]) / n * 1e6
}
res <- list()
for (r in seq_len(repeats)) {
  for (mode in c("compiled", "reticulate")) {
    ampkit:::use_crossing(mode == "compiled")
    epoch(50L)  # warm
    for (name in names(lines)) {
      res[[mode]][[name]] <- c(res[[mode]][[name]], cpu_us(lines[[name]], calls))
    }
  }
  ampkit:::use_crossing(TRUE)
  t <- system.time(do.call(py$py_epoch, c(twin, list(as.integer(calls)))))
  res$python <- c(res$python, (t[["user.self"]] + t[["sys.self"]]) / calls * 1e6)
}
ampkit:::use_crossing(TRUE)
med <- stats::median
keep <- names(lines)
tab <- data.frame(line = keep,
                  compiled_us = round(vapply(keep, function(n) med(res$compiled[[n]]), 0), 1),
                  reticulate_us = round(vapply(keep, function(n) med(res$reticulate[[n]]), 0), 1))
tab$saved_us <- tab$reticulate_us - tab$compiled_us
cat(sprintf("CPU us per call, median of %d x %d calls (torch on one thread); ampkit %s, reticulate %s\n",
            repeats, calls, utils::packageVersion("ampkit"), utils::packageVersion("reticulate")))
print(tab, row.names = FALSE)
cat(sprintf("Python twin of the whole step (r_bridge.amp_step): %.1f us\n", med(res$python)))
