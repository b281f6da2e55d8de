# Per-step overhead of driving the seed's AMP loop from R (ampkit's R package
# over reticulate) against the same loop driven from Python, in the same
# process, on the same data and model sizes, interleaved repeats.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<repo>/.rlib OMP_NUM_THREADS=1 \
#     Rscript benchmarks/r/overhead.R [steps=200] [repeats=7]
#
# Prints, per size and variant, the median ms/step of each driver and the
# difference in microseconds per step. Times are the process's CPU time
# (user + system; torch and OpenMP on one thread), which other processes on a
# busy machine disturb much less than wall time; wall-time medians are
# printed too.
args <- as.integer(commandArgs(trailingOnly = TRUE))
steps <- if (length(args) >= 1) args[[1]] else 200L
repeats <- if (length(args) >= 2) args[[2]] else 7L

library(ampkit)
# Start Python through the package first: it loads torch with its own BLAS (see
# keep_torch_blas()); a torch imported by reticulate first would use R's sgemm.
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)

reticulate::py_run_string("
import time, torch, ampkit

def py_loop(net, loss_fn, opt, scaler, data, targets, steps, autocast):
    n = len(data)
    t0, w0 = time.process_time(), time.perf_counter()
    for s in range(steps):
        i = s % n
        with ampkit.autocast('cpu', enabled=autocast):
            output = net(data[i])
            loss = loss_fn(output, targets[i])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return [(time.process_time() - t0) / steps, (time.perf_counter() - w0) / steps]
")
py_loop <- reticulate::py_eval("py_loop")

# The seed's loop from R; `region(autocast, code)` enters the autocast region.
seed_loop <- function(region) {
  function(net, loss_fn, opt, scaler, data, targets, steps, autocast) {
    n <- length(data)
    t0 <- cpu_wall()
    for (s in seq_len(steps)) {
      i <- (s - 1L) %% n + 1L
      region(autocast, {
        output <- net(data[[i]])
        loss <- loss_fn(output, targets[[i]])
      })
      if (is.null(scaler)) {
        loss$backward()
        opt$step()
      } else {
        scaler$scale(loss)$backward()
        scaler$step(opt)
        scaler$update()
      }
      opt$zero_grad()
    }
    (cpu_wall() - t0) / steps
  }
}

r_loop <- seed_loop(function(autocast, code) with_autocast(code, enabled = autocast, device_type = "cpu"))

cpu_wall <- function() {
  p <- proc.time()
  c(p[["user.self"]] + p[["sys.self"]], p[["elapsed"]])
}

# The same loop written against the Python objects through reticulate alone
# (reticulate's `with()` and `$` on the Python scaler): what the R layer saves.
ak <- reticulate::import("ampkit")
direct_loop <- seed_loop(function(autocast, code) with(ak$autocast("cpu", enabled = autocast), code))

make_model <- function(in_size, out_size, num_layers) {
  layers <- list()
  for (i in seq_len(num_layers - 1)) layers <- c(layers, list(nn_linear(in_size, in_size), nn_relu()))
  nn_sequential(!!!c(layers, list(nn_linear(in_size, out_size))))
}

sizes <- list(tiny = c(batch = 8, width = 16), small = c(batch = 64, width = 256))
variants <- list(
  fp32 = list(autocast = FALSE, scale = FALSE),
  autocast = list(autocast = TRUE, scale = FALSE),
  autocast_scaler = list(autocast = TRUE, scale = TRUE)
)
rows <- list()
for (sz in names(sizes)) {
  b <- sizes[[sz]][["batch"]]
  w <- sizes[[sz]][["width"]]
  torch_manual_seed(1)
  data <- lapply(1:10, function(i) torch_randn(b, w))
  targets <- lapply(1:10, function(i) torch_randn(b, w))
  for (vn in names(variants)) {
    v <- variants[[vn]]
    fresh <- function() {
      net <- make_model(w, w, 3)
      opt <- optim_sgd(net$parameters, lr = 1e-3)
      scaler <- if (v$scale) amp_grad_scaler("cpu") else NULL
      list(net = net, loss_fn = nn_mse_loss(), opt = opt, scaler = scaler)
    }
    t_r <- t_py <- t_d <- matrix(0, repeats, 2)
    for (k in seq_len(repeats)) {
      m <- fresh()
      t_py[k, ] <- unlist(py_loop(m$net, m$loss_fn, m$opt, if (is.null(m$scaler)) NULL else m$scaler$py,
                         data, targets, as.integer(steps), v$autocast))
      m <- fresh()
      t_r[k, ] <- r_loop(m$net, m$loss_fn, m$opt, m$scaler, data, targets, steps, v$autocast)
      m <- fresh()
      t_d[k, ] <- direct_loop(m$net, m$loss_fn, m$opt, if (is.null(m$scaler)) NULL else m$scaler$py,
                              data, targets, steps, v$autocast)
    }
    rows[[length(rows) + 1]] <- data.frame(
      size = sprintf("%s (batch %d, width %d, 3 layers)", sz, b, w), variant = vn,
      python_ms = round(median(t_py[, 1]) * 1e3, 3), r_ms = round(median(t_r[, 1]) * 1e3, 3),
      overhead_us = round((median(t_r[, 1]) - median(t_py[, 1])) * 1e6, 1),
      direct_ms = round(median(t_d[, 1]) * 1e3, 3),
      wall_python_ms = round(median(t_py[, 2]) * 1e3, 3), wall_r_ms = round(median(t_r[, 2]) * 1e3, 3))
  }
}
out <- do.call(rbind, rows)
cat(sprintf("steps per repeat: %d, repeats: %d (medians of CPU time per step), torch threads: 1\n", steps, repeats))
print(out, row.names = FALSE)
