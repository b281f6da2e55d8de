# What each line of the seed's AMP step costs from R, against the same line in Python:
# host time per line (medians over many steps, tiny tensors on the CPU, so that the
# step is host-bound as the seed_mlp case is on a GPU) and, in a separate traced run,
# the calls each line makes into reticulate's C++ layer (Python calls, conversions).
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<repo>/.rlib OMP_NUM_THREADS=1 \
#     Rscript benchmarks/r/step_lines.R <out-dir> [steps=2000] [label]
#
# Writes <out-dir>/step_lines.txt: one row per line of the step (R us, Python us, the
# difference, reticulate calls per step), for the AMP step (autocast + scaler) and the
# fp32 step (loss$backward(), opt$step()). First quartiles over the steps (a shared
# machine's preemption inflates the rest). The line's time is the span between the
# timestamps around it (Sys.time() in R, time.perf_counter() in Python); the clock's own
# cost is measured and subtracted.
args <- commandArgs(trailingOnly = TRUE)
out_dir <- if (length(args) >= 1) args[[1]] else "."
steps <- if (length(args) >= 2) as.integer(args[[2]]) else 2000L
label <- if (length(args) >= 3) args[[3]] else ""
dir.create(out_dir, showWarnings = FALSE, recursive = TRUE)

# Counting needs the traced functions bound by the package, so it runs in a child
# process: `step_lines.R <out> <steps> <label> count`; it traces reticulate's .Call
# wrappers before the package binds any of them.
count_mode <- length(args) >= 4 && args[[4]] == "count"
if (count_mode) {
  source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "trace_calls.R"))
  .cnt <- trace_reticulate()
}

library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
options(warn = -1)

torch_manual_seed(1)
batch_size <- 8; in_size <- 16; out_size <- 16; nb <- 10
data <- lapply(1:nb, function(i) torch_randn(batch_size, in_size))
targets <- lapply(1:nb, function(i) torch_randn(batch_size, out_size))
make_model <- function() {
  nn_sequential(nn_linear(in_size, in_size), nn_relu(), nn_linear(in_size, in_size), nn_relu(),
                nn_linear(in_size, out_size))
}

AMP_LINES <- c("with_autocast: enter", "output <- net(x)", "loss <- loss_fn(output, y)",
               "with_autocast: exit", "scaler$scale(loss)$backward()", "scaler$step(opt)",
               "scaler$update()", "opt$zero_grad()")
FP32_LINES <- c("output <- net(x)", "loss <- loss_fn(output, y)", "loss$backward()", "opt$step()",
                "opt$zero_grad()")

now <- function() as.numeric(Sys.time())
snap <- function() if (count_mode) unlist(mget(ls(.cnt), .cnt)) else 0

# The seed's steps, a timestamp (and, counting, a snapshot) after every line.
r_amp <- function(n) {
  net <- make_model(); loss_fn <- nn_mse_loss(); opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
  t <- matrix(0, n, 9); cnt <- vector("list", 9)
  for (s in seq_len(n)) {
    i <- (s - 1L) %% nb + 1L
    t[s, 1] <- now(); c1 <- snap()
    with_autocast(device_type = "cpu", {
      t[s, 2] <- now(); c2 <- snap()
      output <- net(data[[i]])
      t[s, 3] <- now(); c3 <- snap()
      loss <- loss_fn(output, targets[[i]])
      t[s, 4] <- now(); c4 <- snap()
    })
    t[s, 5] <- now(); c5 <- snap()
    scaler$scale(loss)$backward()
    t[s, 6] <- now(); c6 <- snap()
    scaler$step(opt)
    t[s, 7] <- now(); c7 <- snap()
    scaler$update()
    t[s, 8] <- now(); c8 <- snap()
    opt$zero_grad()
    t[s, 9] <- now(); c9 <- snap()
    if (count_mode && s == n) cnt <- list(c1, c2, c3, c4, c5, c6, c7, c8, c9)
  }
  list(t = t, cnt = cnt)
}

r_fp32 <- function(n) {
  net <- make_model(); loss_fn <- nn_mse_loss(); opt <- optim_sgd(net$parameters, lr = 0.1)
  t <- matrix(0, n, 6); cnt <- vector("list", 6)
  for (s in seq_len(n)) {
    i <- (s - 1L) %% nb + 1L
    t[s, 1] <- now(); c1 <- snap()
    output <- net(data[[i]])
    t[s, 2] <- now(); c2 <- snap()
    loss <- loss_fn(output, targets[[i]])
    t[s, 3] <- now(); c3 <- snap()
    loss$backward()
    t[s, 4] <- now(); c4 <- snap()
    opt$step()
    t[s, 5] <- now(); c5 <- snap()
    opt$zero_grad()
    t[s, 6] <- now(); c6 <- snap()
    if (count_mode && s == n) cnt <- list(c1, c2, c3, c4, c5, c6)
  }
  list(t = t, cnt = cnt)
}

if (count_mode) {
  rows <- list()
  for (what in c("amp", "fp32")) {
    res <- if (what == "amp") r_amp(20) else r_fp32(20)
    lines <- if (what == "amp") AMP_LINES else FP32_LINES
    # the enter of the region is the span from the first timestamp to the one inside it
    for (k in seq_along(lines)) {
      d <- res$cnt[[k + 1]] - res$cnt[[k]]
      d <- d[d > 0]
      rows[[length(rows) + 1]] <- data.frame(
        step = what, line = lines[[k]], reticulate_calls = sum(d),
        python_calls = if ("py_call_impl" %in% names(d)) d[["py_call_impl"]] else 0,
        detail = if (length(d)) paste(sprintf("%s %g", names(d), d), collapse = ", ") else "")
    }
  }
  saveRDS(do.call(rbind, rows), file.path(out_dir, "step_lines_counts.rds"))
  quit(save = "no")
}

reticulate::py_run_string("
import time, torch, ampkit
_now = time.perf_counter

def py_amp(net, data, targets, n):
    loss_fn = torch.nn.MSELoss(); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.GradScaler('cpu', init_scale=2.0**10)
    nb = len(data); rows = []
    for s in range(n):
        i = s % nb
        t1 = _now()
        with ampkit.autocast('cpu'):
            t2 = _now()
            output = net(data[i])
            t3 = _now()
            loss = loss_fn(output, targets[i])
            t4 = _now()
        t5 = _now()
        scaler.scale(loss).backward()
        t6 = _now()
        scaler.step(opt)
        t7 = _now()
        scaler.update()
        t8 = _now()
        opt.zero_grad()
        t9 = _now()
        rows.append((t1, t2, t3, t4, t5, t6, t7, t8, t9))
    return rows

def py_fp32(net, data, targets, n):
    loss_fn = torch.nn.MSELoss(); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    nb = len(data); rows = []
    for s in range(n):
        i = s % nb
        t1 = _now()
        output = net(data[i])
        t2 = _now()
        loss = loss_fn(output, targets[i])
        t3 = _now()
        loss.backward()
        t4 = _now()
        opt.step()
        t5 = _now()
        opt.zero_grad()
        t6 = _now()
        rows.append((t1, t2, t3, t4, t5, t6))
    return rows

def clock_cost(n=100000):
    t0 = _now()
    for _ in range(n):
        _now()
    return (_now() - t0) / n
")
pym <- reticulate::import_main()
py_model <- make_model

# R's clock cost per timestamp (the assignment into the matrix included)
clock_r <- local({
  t <- matrix(0, 10000, 1)
  t0 <- now(); for (s in 1:10000) t[s, 1] <- now(); (now() - t0) / 10000
})
clock_py <- pym$clock_cost()

# The first quartile of each line's times: on a shared machine, preemption inflates the
# upper part of the distribution; the lower quartile is the undisturbed cost.
per_line <- function(t, clock) {
  d <- t[, -1, drop = FALSE] - t[, -ncol(t), drop = FALSE]
  apply(d, 2, quantile, 0.25, names = FALSE) - clock
}

warm <- 200L
invisible(r_amp(warm)); invisible(pym$py_amp(py_model(), data, targets, warm))
invisible(r_fp32(warm)); invisible(pym$py_fp32(py_model(), data, targets, warm))
rounds <- 3L
acc <- list(r_amp = NULL, py_amp = NULL, r_fp32 = NULL, py_fp32 = NULL)
for (k in seq_len(rounds)) {  # interleaved
  acc$r_amp <- rbind(acc$r_amp, r_amp(steps)$t)
  acc$py_amp <- rbind(acc$py_amp, do.call(rbind, lapply(pym$py_amp(py_model(), data, targets, steps), unlist)))
  acc$r_fp32 <- rbind(acc$r_fp32, r_fp32(steps)$t)
  acc$py_fp32 <- rbind(acc$py_fp32, do.call(rbind, lapply(pym$py_fp32(py_model(), data, targets, steps), unlist)))
}
step_ms <- function(t) quantile(t[, ncol(t)] - t[, 1], 0.25, names = FALSE) * 1e3

# counts, from a child process that traces reticulate
cmd <- sprintf("%s %s %s 20 %s count", file.path(R.home("bin"), "Rscript"),
               shQuote(normalizePath(sub("^--file=", "", grep("^--file=", commandArgs(), value = TRUE)))),
               shQuote(out_dir), shQuote(label))
system(cmd)
counts <- readRDS(file.path(out_dir, "step_lines_counts.rds"))

table_for <- function(what, lines, rt, pt) {
  r_us <- per_line(rt, clock_r) * 1e6
  p_us <- per_line(pt, clock_py) * 1e6
  cn <- counts[counts$step == what, ]
  data.frame(line = lines, r_us = round(r_us, 1), python_us = round(p_us, 1),
             r_minus_python_us = round(r_us - p_us, 1), python_calls = cn$python_calls,
             reticulate_calls = cn$reticulate_calls)
}
amp <- table_for("amp", AMP_LINES, acc$r_amp, acc$py_amp)
fp32 <- table_for("fp32", FP32_LINES, acc$r_fp32, acc$py_fp32)
commit <- tryCatch(system("git rev-parse --short HEAD", intern = TRUE), error = function(e) "?")
sink(file.path(out_dir, "step_lines.txt"))
cat(sprintf("Per-line host cost of the seed's step from R and from Python, one process, %s (commit %s)\n", label, commit))
cat(sprintf("CPU, torch threads 1, batch %d, width %d, 3 linear layers; first quartiles over %d x %d steps after %d warm-up; clock cost subtracted (R %.2f us, Python %.2f us)\n",
            batch_size, in_size, rounds, steps, warm, clock_r * 1e6, clock_py * 1e6))
cat(sprintf("Command: Rscript benchmarks/r/step_lines.R %s %d %s\n\n", out_dir, steps, label))
cat(sprintf("AMP step (autocast + scaler): R %.3f ms/step, Python %.3f ms/step (first quartiles of the whole step)\n",
            step_ms(acc$r_amp), step_ms(acc$py_amp)))
print(amp, row.names = FALSE)
cat(sprintf("\nfp32 step: R %.3f ms/step, Python %.3f ms/step\n", step_ms(acc$r_fp32), step_ms(acc$py_fp32)))
print(fp32, row.names = FALSE)
cat("\nreticulate calls per line (traced run):\n")
for (k in seq_len(nrow(counts))) cat(sprintf("  %s | %s: %s\n", counts$step[k], counts$line[k], counts$detail[k]))
sink()
cat(readLines(file.path(out_dir, "step_lines.txt")), sep = "\n")
