# The garbage watch on a GPU (R/memory.R): what an R user's loop holds with it
# on and off, and what it costs.
#
#   Rscript benchmarks/r/gc_cost.R [steps]
#
# The loop is the seed's hand-written one (`output <- net(x)` each step) with a
# 1 GiB float32 output a step (8192 x 32768, the transformer case's logits).
# Prints, per threshold, the peak CUDA memory allocated and the memory still
# allocated after the loop, then the cost of the memory reading (from R,
# through reticulate, and in Python alone) and of R's gc() (young and full) in
# this session.
library(ampkit)
args <- commandArgs(trailingOnly = TRUE)
steps <- if (length(args)) as.integer(args[[1]]) else 20L
stopifnot(cuda_is_available())
torch <- reticulate::import("torch")
mib <- function(b) sprintf("%.0f MiB", b / 2^20)

loop <- function(threshold) {
  old <- options(ampkit.gc_threshold_mb = threshold)
  on.exit(options(old))
  torch_manual_seed(1)
  net <- nn_linear(1024, 32768)$cuda()
  x <- torch_randn(8192, 1024, device = "cuda")
  y <- torch$zeros(8192L, 32768L, device = "cuda")
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 1e-3)
  amp_gc()
  torch$cuda$reset_peak_memory_stats()
  before <- amp_gc()$collections
  t0 <- Sys.time()
  for (i in seq_len(steps)) {
    output <- net(x)
    loss <- loss_fn(output, y)
    loss$backward()
    opt$step()
    opt$zero_grad()
  }
  torch$cuda$synchronize()
  secs <- as.numeric(Sys.time() - t0, units = "secs")
  res <- list(threshold = threshold, peak = torch$cuda$max_memory_allocated(),
              end = torch$cuda$memory_allocated(),
              collections = amp_gc()$collections - before, ms_per_step = 1000 * secs / steps)
  cat(sprintf("threshold %s MiB: %d steps, peak %s, allocated after the loop %s, %d automatic collections, %.1f ms/step\n",
              format(threshold), steps, mib(res$peak), mib(res$end), res$collections, res$ms_per_step))
  res
}

cat("card:", torch$cuda$get_device_name(0L), "\n")
for (thr in c(Inf, 1024, 256)) loop(thr)

med_us <- function(f, n) {
  t <- vapply(seq_len(n), function(i) { t0 <- Sys.time(); f(); as.numeric(Sys.time() - t0, units = "secs") }, 0)
  1e6 * stats::median(t)
}
read <- ampkit:::.h$memory_allocated
cat(sprintf("memory reading from R (one reticulate call): %.1f us (median of 2000)\n", med_us(read, 2000)))
py <- reticulate::py_run_string(paste(
  "import timeit, torch",
  "n = 20000",
  "t_stats = timeit.timeit(lambda: torch._C._cuda_memoryStats(0)['allocated_bytes']['all']['current'], number=n) / n * 1e6",
  "t_api = timeit.timeit(torch.cuda.memory_allocated, number=n) / n * 1e6", sep = "\n"))
cat(sprintf("memory reading in Python: %.1f us (nested stats, what ampkit uses), %.1f us (torch.cuda.memory_allocated)\n",
            py$t_stats, py$t_api))
cat(sprintf("R gc(full = FALSE): %.0f us; gc(): %.0f us (median of 20; Ncells in use %d)\n",
            med_us(function() gc(full = FALSE), 20), med_us(function() gc(), 20), gc()[1, 1]))
