# Where the time of the seed's AMP loop goes when it is driven from R: R's
# sampling profiler (Rprof) and Python's cProfile over the same steps, in the
# same run, then the R loop against its Python twin (same process, same
# model sizes, medians after a warm-up).
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<repo>/.rlib OMP_NUM_THREADS=1 \
#     Rscript r/ampkit/bench/profile_seed.R <out-dir> [steps=400] [repeats=5]
#
# Writes <out-dir>/rprof.txt (summaryRprof by self and total time),
# <out-dir>/cprofile.txt (cProfile, by internal and cumulative time) and
# <out-dir>/timing.txt (ms per step, R and Python, per variant: medians of the
# process's CPU time, which other processes on a shared machine disturb less
# than wall time, and of wall time).
args <- commandArgs(trailingOnly = TRUE)
out_dir <- if (length(args) >= 1) args[[1]] else "."
steps <- if (length(args) >= 2) as.integer(args[[2]]) else 400L
repeats <- if (length(args) >= 3) as.integer(args[[3]]) else 5L
dir.create(out_dir, showWarnings = FALSE, recursive = TRUE)

library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
options(warn = -1)

batch_size <- 8; in_size <- 16; out_size <- 16; num_layers <- 3; num_batches <- 10
torch_manual_seed(1)
data <- lapply(1:num_batches, function(x) torch_randn(batch_size, in_size, device = "cpu"))
targets <- lapply(1:num_batches, function(x) torch_randn(batch_size, out_size, device = "cpu"))

make_model <- function(in_size, out_size, num_layers) {
  layers <- list()
  for (i in seq_len(num_layers - 1)) {
    layers <- c(layers, list(nn_linear(in_size, in_size), nn_relu()))
  }
  layers <- c(layers, list(nn_linear(in_size, out_size)))
  nn_sequential(!!!layers)$cuda()
}

# The seed's run() as written (device strings "cpu"), with a step count.
run <- function(autocast, scale, steps) {
  loss_fn <- nn_mse_loss()$cuda()
  net <- make_model(in_size, out_size, num_layers)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu", enabled = scale)
  n <- 0L
  while (n < steps) {
    for (i in seq_along(data)) {
      with_autocast(enabled = autocast, device_type = "cpu", {
        output <- net(data[[i]])
        loss <- loss_fn(output, targets[[i]])
      })
      scaler$scale(loss)$backward()
      scaler$step(opt)
      scaler$update()
      opt$zero_grad()
      n <- n + 1L
      if (n >= steps) break
    }
  }
  loss$item()
}

reticulate::py_run_string("
import time, torch, ampkit

def make_model(in_size, out_size, num_layers):
    layers = []
    for i in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers += [torch.nn.Linear(in_size, out_size)]
    return torch.nn.Sequential(*layers)

def py_run(autocast, scale, steps, data, targets, in_size, out_size, num_layers):
    loss_fn = torch.nn.MSELoss()
    net = make_model(in_size, out_size, num_layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.GradScaler('cpu', enabled=scale)
    n = 0
    while n < steps:
        for i in range(len(data)):
            with ampkit.autocast('cpu', enabled=autocast):
                output = net(data[i])
                loss = loss_fn(output, targets[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            n += 1
            if n >= steps:
                break
    return loss.item()
")
py_run <- reticulate::py_eval("py_run")
py_side <- function(autocast, scale, steps) {
  py_run(autocast, scale, as.integer(steps), data, targets, as.integer(in_size),
         as.integer(out_size), as.integer(num_layers))
}

# ---- profiles: the R-driven loop, autocast + scaler, both profilers at once
run(TRUE, TRUE, 50L)  # warm-up
cprof <- reticulate::import("cProfile")$Profile()
rprof_file <- tempfile(fileext = ".out")
Rprof(rprof_file, interval = 0.002)
cprof$enable()
t_prof <- system.time(run(TRUE, TRUE, steps))
cprof$disable()
Rprof(NULL)
sr <- summaryRprof(rprof_file)
sink(file.path(out_dir, "rprof.txt"))
cat(sprintf("R seed loop (autocast + scaler), %d steps, batch %d, width %d; elapsed %.3f s (profiled)\n",
            steps, batch_size, in_size, t_prof[["elapsed"]]))
cat("Command: Rscript r/ampkit/bench/profile_seed.R", out_dir, steps, repeats, "\n\n")
cat("== by.self (top 30)\n"); print(head(sr$by.self, 30))
cat("\n== by.total (top 40)\n"); print(head(sr$by.total, 40))
sink()
pstats <- reticulate::import("pstats")
io <- reticulate::import("io")
buf <- io$StringIO()
st <- pstats$Stats(cprof, stream = buf)
st$sort_stats("tottime")$print_stats(30L)
st$sort_stats("cumulative")$print_stats(30L)
writeLines(c(sprintf("Python side of the same R-driven run (cProfile), %d steps", steps),
             paste("Command: Rscript r/ampkit/bench/profile_seed.R", out_dir, steps, repeats),
             buf$getvalue()), file.path(out_dir, "cprofile.txt"))

# ---- timing: R loop vs Python twin, interleaved, medians after a warm-up
variants <- list(default = c(FALSE, FALSE), autocast = c(TRUE, FALSE), autocast_scaler = c(TRUE, TRUE))
rows <- list()
for (vn in names(variants)) {
  v <- variants[[vn]]
  run(v[1], v[2], 50L); py_side(v[1], v[2], 50L)
  tr <- tp <- wr <- wp <- numeric(repeats)
  cpu <- function(t) t[["user.self"]] + t[["sys.self"]]
  for (k in seq_len(repeats)) {
    t <- system.time(py_side(v[1], v[2], steps))
    tp[k] <- cpu(t) / steps; wp[k] <- t[["elapsed"]] / steps
    t <- system.time(run(v[1], v[2], steps))
    tr[k] <- cpu(t) / steps; wr[k] <- t[["elapsed"]] / steps
  }
  rows[[vn]] <- data.frame(variant = vn, python_ms = round(median(tp) * 1e3, 3),
                           r_ms = round(median(tr) * 1e3, 3),
                           r_over_python = round(median(tr) / median(tp), 2),
                           r_extra_us = round((median(tr) - median(tp)) * 1e6),
                           wall_python_ms = round(median(wp) * 1e3, 3), wall_r_ms = round(median(wr) * 1e3, 3))
}
tab <- do.call(rbind, rows)
sink(file.path(out_dir, "timing.txt"))
cat(sprintf("Seed loop, batch %d, width %d, %d layers, %d steps per repeat, %d repeats (median process CPU ms/step, user + system; wall medians too), torch threads 1\n",
            batch_size, in_size, num_layers, steps, repeats))
cat("Command: Rscript r/ampkit/bench/profile_seed.R", out_dir, steps, repeats, "\n")
print(tab, row.names = FALSE)
sink()
print(tab, row.names = FALSE)
