# Where the time of the seed's AMP loop goes when it is driven from R: R's
# sampling profiler (Rprof) and Python's cProfile over the same steps, in the
# same run, then the R loop against its Python twin (same process, same
# model sizes, medians after a warm-up). The loop is the seed's run() as
# written (bench/seed_loop.R), on the CPU, at small sizes.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<repo>/.rlib OMP_NUM_THREADS=1 \
#     Rscript r/ampkit/bench/profile_seed.R <out-dir> [steps=400] [repeats=5]
#
# Writes <out-dir>/rprof.txt (summaryRprof by self and total time),
# <out-dir>/cprofile.txt (cProfile, by internal and cumulative time) and
# <out-dir>/timing.txt (ms per step, R and Python, per variant: medians of the
# process's CPU time, which other processes on a shared machine disturb less
# than wall time, and of wall time).
#
# With a fourth argument `count` it only counts, per step, the calls the R loop makes
# into reticulate's C++ layer (every `.Call` of reticulate: Python calls, attribute
# lookups, conversions) and reticulate's R-level r_to_py() dispatches, for the
# default, autocast and autocast + scaler loops: <out-dir>/crossings.txt. Counting
# traces reticulate's functions (slow), so it runs in its own process:
#
#   Rscript r/ampkit/bench/profile_seed.R <out-dir> 100 1 count
args <- commandArgs(trailingOnly = TRUE)
out_dir <- if (length(args) >= 1) args[[1]] else "."
steps <- if (length(args) >= 2) as.integer(args[[2]]) else 400L
repeats <- if (length(args) >= 3) as.integer(args[[3]]) else 5L
count_mode <- length(args) >= 4 && args[[4]] == "count"
dir.create(out_dir, showWarnings = FALSE, recursive = TRUE)

if (count_mode) {  # before the package binds any reticulate function
  source(file.path(Sys.getenv("AMPKIT_REPO", "."), "r", "ampkit", "bench", "trace_calls.R"))
  .cnt <- trace_reticulate("r_to_py")
}

library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
options(warn = -1)

source(file.path(Sys.getenv("AMPKIT_REPO", "."), "r", "ampkit", "bench", "seed_loop.R"))
# The seed's run() as written, on the CPU, steps = num_batches x epochs.
seed_at <- function(steps) {
  seed_loop("cpu", c(batch_size = 8, in_size = 16, out_size = 16, num_layers = 3, num_batches = 10,
                     epochs = max(1, steps %/% 10)))
}
seeds <- list(warm = seed_at(50), timed = seed_at(steps))
batch_size <- 8; in_size <- 16; num_layers <- 3
steps <- seeds$timed$steps
run <- function(autocast, scale, n) (if (n <= 50) seeds$warm else seeds$timed)$run(autocast, scale)
py_side <- function(autocast, scale, n) (if (n <= 50) seeds$warm else seeds$timed)$py_run(autocast, scale)

if (count_mode) {
  counts <- function(autocast, scale, n) {
    for (k in ls(.cnt)) .cnt[[k]] <- 0
    run(autocast, scale, n)
    unlist(mget(ls(.cnt), .cnt))
  }
  variants <- list(default = c(FALSE, FALSE), autocast = c(TRUE, FALSE), autocast_scaler = c(TRUE, TRUE))
  for (v in variants) run(v[1], v[2], 50L)  # warm-up: one-time imports and lookups
  rows <- list()
  for (vn in names(variants)) {
    v <- variants[[vn]]
    # per step: the difference of a long and a short run (setup calls cancel)
    d <- (counts(v[1], v[2], steps) - counts(v[1], v[2], 50L)) / (seeds$timed$steps - seeds$warm$steps)
    d <- d[d > 0]
    rows[[vn]] <- data.frame(variant = vn, all_calls = sum(d), python_calls = if ("py_call_impl" %in% names(d)) d[["py_call_impl"]] else 0,
                             r_to_py_dispatch = if ("r_to_py" %in% names(d)) d[["r_to_py"]] else 0,
                             detail = paste(sprintf("%s %.2f", names(d), d), collapse = ", "))
  }
  tab <- do.call(rbind, rows)
  sink(file.path(out_dir, "crossings.txt"))
  cat("Calls per step of the R seed loop into reticulate's C++ layer (.Call entries) and reticulate's R-level r_to_py() dispatches\n")
  cat("Command: Rscript r/ampkit/bench/profile_seed.R", out_dir, steps, repeats, "count\n")
  print(tab[, 1:4], row.names = FALSE)
  cat("\n"); for (vn in names(rows)) cat(vn, ": ", rows[[vn]]$detail, "\n", sep = "")
  sink()
  cat(readLines(file.path(out_dir, "crossings.txt")), sep = "\n")
  quit(save = "no")
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
# (the last row: the AMP loop with the release of dropped outputs off, for its cost)
variants <- list(default = c(FALSE, FALSE), autocast = c(TRUE, FALSE), autocast_scaler = c(TRUE, TRUE),
                 autocast_scaler_release_off = c(TRUE, TRUE))
rows <- list()
gc.time(TRUE)
for (vn in names(variants)) {
  v <- variants[[vn]]
  options(ampkit.release_outputs = !grepl("release_off", vn))
  run(v[1], v[2], 50L); py_side(v[1], v[2], 50L)
  tr <- tp <- wr <- wp <- gr <- numeric(repeats)
  cpu <- function(t) t[["user.self"]] + t[["sys.self"]]
  for (k in seq_len(repeats)) {
    t <- system.time(py_side(v[1], v[2], steps))
    tp[k] <- cpu(t) / steps; wp[k] <- t[["elapsed"]] / steps
    invisible(gc())  # as system.time()'s gcFirst, but before gc.time() is read
    g0 <- gc.time()[[1]]
    t <- system.time(run(v[1], v[2], steps), gcFirst = FALSE)
    gr[k] <- (gc.time()[[1]] - g0) / steps
    tr[k] <- cpu(t) / steps; wr[k] <- t[["elapsed"]] / steps
  }
  # min: the least disturbed repeat on a shared machine (host cost); median as well
  rows[[vn]] <- data.frame(variant = vn, python_ms = round(median(tp) * 1e3, 3),
                           r_ms = round(median(tr) * 1e3, 3),
                           r_over_python = round(median(tr) / median(tp), 2),
                           r_extra_us = round((median(tr) - median(tp)) * 1e6),
                           min_python_ms = round(min(tp) * 1e3, 3), min_r_ms = round(min(tr) * 1e3, 3),
                           r_gc_ms = round(median(gr) * 1e3, 3),
                           wall_python_ms = round(median(wp) * 1e3, 3), wall_r_ms = round(median(wr) * 1e3, 3))
}
tab <- do.call(rbind, rows)
sink(file.path(out_dir, "timing.txt"))
cat(sprintf("Seed loop, batch %d, width %d, %d layers, %d steps per repeat, %d repeats (median and min process CPU ms/step, user + system; r_gc_ms: R's own garbage collections in the R loop, ms/step (gc.time()); wall medians too), torch threads 1\n",
            batch_size, in_size, num_layers, steps, repeats))
cat("Command: Rscript r/ampkit/bench/profile_seed.R", out_dir, steps, repeats, "\n")
print(tab, row.names = FALSE)
sink()
print(tab, row.names = FALSE)
