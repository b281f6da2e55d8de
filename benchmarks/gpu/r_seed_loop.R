# The seed's AMP loop from R against its Python twin, on the GPU (or, for a dry run, the
# CPU): time and peak device memory of the three runs of the seed's benchmark (default,
# autocast, autocast + scaler), and the largest transformer batch that fits, by bisection.
#
#   Rscript benchmarks/gpu/r_seed_loop.R seed <out-dir>            # R and Python, one process
#   Rscript benchmarks/gpu/r_seed_loop.R bisect-r <out-dir>        # largest batch from R
#   Rscript benchmarks/gpu/r_seed_loop.R bisect-python <out-dir>   # the same loop in Python
#
# benchmarks/gpu/r_seed_loop.sh runs all three on the device (R from the carried runtime).
# Environment: AMPKIT_SEED_DEVICE (default cuda), AMPKIT_SEED_SIZES ("batch,in,out,layers,
# batches,epochs"; default the seed's 512,4096,4096,3,50,3), AMPKIT_SEED_REPEATS (5),
# AMPKIT_BISECT_PROFILE (full), AMPKIT_BISECT_MAX (4096), AMPKIT_BISECT_STEPS (3).
args <- commandArgs(trailingOnly = TRUE)
mode <- if (length(args) >= 1) args[[1]] else "seed"
out_dir <- if (length(args) >= 2) args[[2]] else "."
dir.create(out_dir, showWarnings = FALSE, recursive = TRUE)
device <- Sys.getenv("AMPKIT_SEED_DEVICE", "cuda")
sizes <- as.integer(strsplit(Sys.getenv("AMPKIT_SEED_SIZES", "512,4096,4096,3,50,3"), ",")[[1]])
repeats <- as.integer(Sys.getenv("AMPKIT_SEED_REPEATS", "5"))

library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
if (device == "cpu") torch$set_num_threads(1L)
cuda <- device == "cuda"
sync <- function() if (cuda) torch$cuda$synchronize()
peak_reset <- function() if (cuda) { torch$cuda$synchronize(); torch$cuda$reset_peak_memory_stats() }
# Read as a Python float: reticulate 1.28 turns a Python int past 2^31 into a wrapped R integer.
torch_raw <- reticulate::import("torch", convert = FALSE)
peak_mib <- function() if (cuda) reticulate::py_to_r(torch_raw$cuda$max_memory_allocated()$`__float__`()) / 2^20 else NA_real_
clean <- function() { amp_gc(); if (cuda) torch$cuda$empty_cache() }
card <- if (cuda) torch$cuda$get_device_name(0L) else "cpu"
say <- function(...) { cat(sprintf(...), "\n", sep = ""); flush.console() }
say("device: %s; torch %s; mode %s", card, torch$`__version__`, mode)

py <- reticulate::import_main()

if (mode == "seed") {
  # The seed's run() as written (benchmarks/r/seed_loop.R: the fixture's code with
  # its sizes and device strings set) and its Python twin on the same data.
  source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "seed_loop.R"))
  seed <- seed_loop(device, c(batch_size = sizes[[1]], in_size = sizes[[2]], out_size = sizes[[3]],
                              num_layers = sizes[[4]], num_batches = sizes[[5]], epochs = sizes[[6]]))
  run <- seed$run
  py_run <- seed$py_run
  # R's own collections (gc.time()) and the outputs the package freed (released) in a
  # run: what automatic memory handling costs, beside the run's time.
  gc.time(TRUE)
  released <- function() ampkit:::.rel$released
  timed <- function(f, autocast, scale) {
    clean(); peak_reset(); sync()
    g0 <- gc.time()[[1]]; r0 <- released()
    t <- system.time({ f(autocast, scale); sync() }, gcFirst = FALSE)
    c(seconds = t[["elapsed"]], peak_mib = peak_mib(), r_gc_s = gc.time()[[1]] - g0,
      released = released() - r0)
  }
  variants <- list(default = c(FALSE, FALSE), autocast = c(TRUE, FALSE), autocast_scaler = c(TRUE, TRUE))
  withCallingHandlers({
    for (v in variants) { run(v[1], v[2]); py_run(v[1], v[2]) }  # warm-up: kernels, allocator
    res <- list()
    for (k in seq_len(repeats)) {
      for (vn in names(variants)) {   # interleaved: R, Python, each variant, each repeat
        v <- variants[[vn]]
        res[[length(res) + 1]] <- data.frame(variant = vn, lang = "R", rep = k, t(timed(run, v[1], v[2])))
        res[[length(res) + 1]] <- data.frame(variant = vn, lang = "python", rep = k, t(timed(py_run, v[1], v[2])))
      }
    }
    # The R AMP loop with the release of dropped outputs off (its effect on peak memory)
    options(ampkit.release_outputs = FALSE)
    off <- do.call(rbind, lapply(seq_len(repeats), function(k) t(timed(run, TRUE, TRUE))))
    options(ampkit.release_outputs = TRUE)
  }, ampkit_cuda_unavailable = function(w) invokeRestart("muffleWarning"),
     ampkit_python_warning = function(w) invokeRestart("muffleWarning"))
  raw <- do.call(rbind, res)
  write.csv(raw, file.path(out_dir, "seed_loop_raw.csv"), row.names = FALSE)
  med <- aggregate(cbind(seconds, peak_mib, r_gc_s, released) ~ variant + lang, raw, median, na.action = na.pass)
  tab <- reshape(med, idvar = "variant", timevar = "lang", direction = "wide")
  tab$r_over_python <- round(tab$seconds.R / tab$seconds.python, 3)
  tab$r_mem_over_python <- round(tab$peak_mib.R / tab$peak_mib.python, 3)
  tab$r_gc_share <- round(tab$r_gc_s.R / tab$seconds.R, 3)
  base <- tab$seconds.R[tab$variant == "default"]
  tab$r_speedup_vs_r_default <- round(base / tab$seconds.R, 3)
  tab$py_speedup_vs_py_default <- round(tab$seconds.python[tab$variant == "default"] / tab$seconds.python, 3)
  sink(file.path(out_dir, "seed_loop.txt"))
  say("The seed's benchmark (3 runs of run(autocast, scale)) from R and its Python twin, one process")
  say("device: %s; sizes batch %d, in %d, out %d, layers %d, batches %d, epochs %d; medians of %d interleaved repeats after a warm-up",
      card, sizes[[1]], sizes[[2]], sizes[[3]], sizes[[4]], sizes[[5]], sizes[[6]], repeats)
  say("automatic collections by ampkit in R: %d", amp_gc()$collections)
  print(tab[, setdiff(names(tab), c("r_gc_s.python", "released.python"))], row.names = FALSE)
  # Paired by repeat: each repeat's speedup over its own float32 run (default), per language,
  # and R's over Python's; the medians of these, with their range, over the repeats.
  speedups <- do.call(rbind, lapply(split(raw, raw$rep), function(d) {
    s <- function(l, v) d$seconds[d$lang == l & d$variant == "default"] / d$seconds[d$lang == l & d$variant == v]
    data.frame(rep = d$rep[[1]], variant = c("autocast", "autocast_scaler"),
               r = c(s("R", "autocast"), s("R", "autocast_scaler")),
               python = c(s("python", "autocast"), s("python", "autocast_scaler")))
  }))
  speedups$r_over_python <- speedups$r / speedups$python
  write.csv(speedups, file.path(out_dir, "seed_loop_speedups.csv"), row.names = FALSE)
  for (v in c("autocast", "autocast_scaler")) {
    d <- speedups[speedups$variant == v, ]
    say("%s, paired by repeat (%d): speedup over the same language's float32 run, median R %.3f, Python %.3f; R's / Python's median %.3f [%.3f, %.3f], above 1 in %d of %d",
        v, nrow(d), median(d$r), median(d$python), median(d$r_over_python), min(d$r_over_python),
        max(d$r_over_python), sum(d$r_over_python >= 1), nrow(d))
  }
  say("r_gc_s.R: seconds of R's own garbage collections in the R run (gc.time()); r_gc_share: of the run's time; released.R: outputs freed by the package in the run")
  say("R autocast + scaler with the release off (options(ampkit.release_outputs = FALSE)), medians: %.3f s, peak %.0f MiB, R gc %.3f s",
      median(off[, "seconds"]), median(off[, "peak_mib"]), median(off[, "r_gc_s"]))
  sink()
  cat(readLines(file.path(out_dir, "seed_loop.txt")), sep = "\n")
}

if (mode %in% c("bisect-r", "bisect-python")) {
  profile <- Sys.getenv("AMPKIT_BISECT_PROFILE", "full")
  max_batch <- as.integer(Sys.getenv("AMPKIT_BISECT_MAX", "4096"))
  steps <- as.integer(Sys.getenv("AMPKIT_BISECT_STEPS", "3"))
  reticulate::py_run_string("
import dataclasses, gc, torch, ampkit, ampkit.bench as bench

def case_at(batch, profile, device):
    case = bench.load_cases()['transformer']
    p = dict(case.profiles[profile]); p['sizes'] = {**p['sizes'], 'batch_size': int(batch)}
    p['num_batches'] = 2
    case = dataclasses.replace(case, profiles={**case.profiles, 'bisect': p})
    return bench.build_case(case, 'bisect', seed=0, device=device)

def py_fits(batch, profile, device, steps):
    b = None
    try:
        b = case_at(batch, profile, device)
        model = b.new_model(); opt = b.new_optimizer(model)
        scaler = ampkit.GradScaler(device)
        for s in range(steps):
            x, y = b.batches[s % len(b.batches)]
            with ampkit.autocast(device):
                loss = b.loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        b = model = opt = scaler = loss = x = y = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
")
  r_fits <- function(batch) {
    ok <- tryCatch({
      b <- py$case_at(as.integer(batch), profile, device)
      model <- b$new_model()
      opt <- b$new_optimizer(model)
      loss_fn <- b$loss_fn
      batches <- b$batches  # a list of (inputs, targets)
      scaler <- amp_grad_scaler(device)
      for (s in seq_len(steps)) {
        xy <- batches[[(s - 1L) %% length(batches) + 1L]]
        x <- xy[[1]]; y <- xy[[2]]
        with_autocast(device_type = device, {
          output <- model(x)
          loss <- loss_fn(output, y)
        })
        scaler$scale(loss)$backward()
        scaler$step(opt)
        scaler$update()
        opt$zero_grad(set_to_none = TRUE)
      }
      TRUE
    }, ampkit_out_of_memory = function(e) FALSE)
    rm(list = intersect(c("b", "model", "opt", "scaler", "output", "loss", "x", "y", "batches", "xy"), ls()))
    clean()
    ok
  }
  fits <- if (mode == "bisect-r") r_fits else function(batch) py$py_fits(as.integer(batch), profile, device, steps)
  lang <- if (mode == "bisect-r") "R" else "python"
  probes <- list()
  probe <- function(batch) {
    t0 <- proc.time()[["elapsed"]]
    ok <- isTRUE(fits(batch))
    probes[[length(probes) + 1]] <<- data.frame(batch = batch, fits = ok, seconds = proc.time()[["elapsed"]] - t0)
    say("%s batch %d: %s", lang, batch, if (ok) "fits" else "out of memory")
    ok
  }
  lo <- 0L; hi <- NA_integer_; b <- 32L
  while (b <= max_batch) { if (probe(b)) { lo <- b; b <- b * 2L } else { hi <- b; break } }
  if (is.na(hi)) hi <- max_batch + 1L
  while (hi - lo > 1L) { mid <- (lo + hi) %/% 2L; if (probe(mid)) lo <- mid else hi <- mid }
  write.csv(do.call(rbind, probes), file.path(out_dir, sprintf("bisect_%s_probes.csv", lang)), row.names = FALSE)
  line <- sprintf("%s: largest transformer batch (profile %s, seq_len from the case, AMP loop: region + scaler, %d steps) that fits on %s: %d%s",
                  lang, profile, steps, card, lo, if (lo >= max_batch) sprintf(" (the cap, AMPKIT_BISECT_MAX=%d)", max_batch) else "")
  writeLines(line, file.path(out_dir, sprintf("bisect_%s.txt", lang)))
  say(line)
}
