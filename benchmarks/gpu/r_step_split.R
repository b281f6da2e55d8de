# Where the R seed loop's step time goes on the GPU: the seed's AMP step (seed_mlp's full
# sizes) written in R, and its Python twin, in one process. For each R loop: ms/step (epochs of 50 steps, synchronized, median of
# the repeats), the time spent inside Python per step (every crossing timed, in epochs of
# their own: by the compiled crossing's own clock, or in Python for reticulate's), R's own
# collections per step (gc.time()), the crossings per step, and, over epochs of their
# own, Rprof's top entries by self time. r_loop crosses through the package's compiled
# crossing when it is in use, r_loop_reticulate through reticulate (the package's path
# without it: ampkit:::use_crossing(FALSE)), in the same process. r_one_call: the whole
# step as one Python call from an R loop, the floor of any R loop that crosses (through
# the compiled crossing, and through reticulate: r_one_call_reticulate).
#
#   Rscript benchmarks/gpu/r_step_split.R [repeats=7]        (AMPKIT_SPLIT_DEVICE=cpu: a dry run)
#
# benchmarks/gpu/r_loop_compare.sh runs it on the device (SPLIT=1).
args <- commandArgs(trailingOnly = TRUE)
repeats <- if (length(args) >= 1) as.integer(args[[1]]) else 7L
device <- Sys.getenv("AMPKIT_SPLIT_DEVICE", "cuda")
sizes <- as.integer(strsplit(Sys.getenv("AMPKIT_SPLIT_SIZES", "512,4096,4096,50"), ",")[[1]])
library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
if (device == "cpu") torch$set_num_threads(1L)
sync <- if (device == "cuda") torch$cuda$synchronize else function() invisible(NULL)
say <- function(...) { cat(sprintf(...), "\n", sep = ""); flush.console() }
say("device: %s; torch %s; sizes %s; repeats %d", if (device == "cuda") torch$cuda$get_device_name(0L) else "cpu",
    torch$`__version__`, paste(sizes, collapse = ","), repeats)

torch_manual_seed(1)
nb <- sizes[[4]]
data <- lapply(seq_len(nb), function(i) torch_randn(sizes[[1]], sizes[[2]], device = device))
targets <- lapply(seq_len(nb), function(i) torch_randn(sizes[[1]], sizes[[3]], device = device))
make <- function() {
  net <- nn_sequential(nn_linear(sizes[[2]], sizes[[2]]), nn_relu(), nn_linear(sizes[[2]], sizes[[2]]), nn_relu(),
                       nn_linear(sizes[[2]], sizes[[3]]))$to(device = device)
  list(net = net, loss_fn = nn_mse_loss(), opt = optim_sgd(net$parameters, lr = 1e-3),
       scaler = amp_grad_scaler(device, init_scale = 2^16))
}
m <- make()
net <- m$net
loss_fn <- m$loss_fn
opt <- m$opt
scaler <- m$scaler

r_epoch <- function() {
  for (i in seq_len(nb)) {
    with_autocast(device_type = device, {
      output <- net(data[[i]])
      loss <- loss_fn(output, targets[[i]])
    })
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    opt$zero_grad()
  }
}

py <- reticulate::py_run_string("
import time, torch, ampkit
from ampkit.r_bridge import amp_step as one_step
def twin(net, loss_fn, opt, scaler, data, targets, device):
    for x, y in zip(data, targets):
        one_step(net, loss_fn, opt, scaler, x, y, device)
inside = [0.0, 0]
def timed(f, *a, **k):
    t = time.perf_counter()
    try:
        return f(*a, **k)
    finally:
        inside[0] += time.perf_counter() - t
        inside[1] += 1
def take():
    out = list(inside); inside[0] = 0.0; inside[1] = 0
    return out
", convert = FALSE)
# The Python objects behind the R ones (a module is an R function holding its object).
pyobj <- function(x) if (is.function(x)) attr(x, "py_object") else reticulate::r_to_py(x)
twin_args <- list(pyobj(net), pyobj(loss_fn), pyobj(opt), scaler$py, reticulate::r_to_py(data),
                  reticulate::r_to_py(targets), device)
py_epoch <- function() do.call(py$twin, twin_args)
# The floor of any R loop that crosses: the whole step as one Python call a step, from an
# R for loop, through the package's raw call (no R code of the package's per step).
one_step <- py$one_step
step_args <- lapply(twin_args[c(1:4)], ampkit:::py_arg)
xs <- lapply(data, ampkit:::py_arg)
ys <- lapply(targets, ampkit:::py_arg)
one_call <- function(call) {
  force(call)
  function() {
    f <- ampkit:::py_fn(one_step)
    for (i in seq_len(nb)) call(f, c(step_args, list(xs[[i]], ys[[i]], device)), NULL)
  }
}

h <- ampkit:::.h
# The package's compiled crossing (when this version has one and it loaded), switched off
# for the loops that cross through reticulate.
compiled <- exists("use_crossing", envir = asNamespace("ampkit")) && ampkit:::crossing_status()$on
crossing <- function(on) if (compiled) ampkit:::use_crossing(on)
say("compiled crossing: %s", if (compiled) "in use" else "none (reticulate's)")
timed_fn <- py$timed
# Time spent inside Python per crossing: reticulate's calls through a timing wrapper in
# Python; the compiled crossing reads its own clock.
with_inside <- function(f) {
  if (compiled && ampkit:::crossing_status()$on) {
    ampkit:::crossing_status(reset = TRUE)
    f()
    got <- ampkit:::crossing_status(reset = TRUE)
    return(c(got$seconds_in_python, got$calls))
  }
  raw <- h$call_raw
  h$call_raw <- function(fn, a, kw) raw(timed_fn, c(list(fn), a), kw)
  on.exit(h$call_raw <- raw)
  reticulate::py_call(py$take)
  f()
  sync()
  unlist(reticulate::py_to_r(reticulate::py_call(py$take)))
}
ms_per_step <- function(f) {
  sync()
  t0 <- as.numeric(Sys.time())
  f()
  sync()
  (as.numeric(Sys.time()) - t0) * 1000 / nb
}

loops <- list(
  r_loop = r_epoch,
  r_loop_reticulate = r_epoch,
  r_one_call = one_call(h$call_raw),
  r_one_call_reticulate = one_call(if (compiled) h$reticulate_call else h$call_raw),
  python = py_epoch)
if (!compiled) loops$r_loop_reticulate <- loops$r_one_call_reticulate <- NULL
through_reticulate <- function(name) grepl("_reticulate$", name)
for (name in names(loops)) {  # warm-up
  crossing(!through_reticulate(name))
  for (k in 1:2) loops[[name]]()
}
times <- list(); gcs <- list(); insides <- list(); calls <- list()
for (rep in seq_len(repeats)) {
  for (name in names(loops)) {
    crossing(!through_reticulate(name))
    g0 <- gc.time()[[1]]
    times[[name]] <- c(times[[name]], ms_per_step(loops[[name]]))
    gcs[[name]] <- c(gcs[[name]], (gc.time()[[1]] - g0) * 1000 / nb)
    if (startsWith(name, "r_loop")) {
      got <- with_inside(loops[[name]])
      sync()
      insides[[name]] <- c(insides[[name]], got[[1]] * 1000 / nb)
      calls[[name]] <- c(calls[[name]], got[[2]] / nb)
    }
  }
}
crossing(TRUE)
py_ms <- median(times$python)
say("\n%-21s %9s %9s %12s %13s %11s %10s", "loop", "ms/step", "vs python", "inside py ms", "outside py ms",
    "R gc ms", "crossings")
for (name in names(loops)) {
  say("%-21s %9.3f %9.3f %12s %13s %11.3f %10s", name, median(times[[name]]), median(times[[name]]) / py_ms,
      if (is.null(insides[[name]])) "-" else sprintf("%.3f", median(insides[[name]])),
      if (is.null(insides[[name]])) "-" else sprintf("%.3f", median(times[[name]]) - median(insides[[name]])),
      median(gcs[[name]]), if (is.null(calls[[name]])) "-" else sprintf("%.1f", median(calls[[name]])))
}
say("(inside py: the crossings' time in Python, timed in epochs of their own; outside: the rest of the R step, less than ms/step minus inside where the GPU is the bottleneck)")

for (name in "r_loop") {
  prof <- tempfile()
  Rprof(prof, interval = 0.002, gc.profiling = TRUE)
  for (k in seq_len(repeats)) loops[[name]]()
  sync()
  Rprof(NULL)
  s <- summaryRprof(prof)$by.self
  say("\nRprof, %s: top entries by self time (%% of the sampled time)", name)
  top <- utils::head(s[, c("self.time", "self.pct")], 12)
  for (k in seq_len(nrow(top))) say("  %-32s %6.1f%%", rownames(top)[[k]], top$self.pct[[k]])
}
