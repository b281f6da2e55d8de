# Peak memory of R's loop against Python's, on the CPU: what each runner's variant (build,
# warm-up, two timed epochs) allocates above its start at its high point, read by the same census
# of torch's allocation records (peak_census.py: a stand-in for CUDA's max_memory_allocated,
# which the CPU does not have), each from a collected start (R: amp_gc(); Python:
# gc.collect()). The R side is benchmarks/run.R's own step (make_step(), make_scaler(),
# sourced); the Python side is the Python runner's (ampkit.bench.VariantRun).
#
#   cd <repo> && RETICULATE_PYTHON=.venv/bin/python R_LIBS=.rlib OMP_NUM_THREADS=1 \
#     Rscript benchmarks/r/peak_census.R [cases, comma-separated] [variants]
#
# Prints one line per case and variant: Python's and R's peak in MiB, and R/Python.
census_args <- commandArgs(trailingOnly = TRUE)
source("benchmarks/run.R")  # the R runner's functions, nothing run (device: cpu)
census_cases <- strsplit(if (length(census_args) >= 1) census_args[[1]]
                         else "transformer,seed_mlp,convnet,text_classifier", ",")[[1]]
census_variants <- strsplit(if (length(census_args) >= 2) census_args[[2]] else "fp32,ampkit_amp", ",")[[1]]
census <- reticulate::import_from_path("peak_census", path = "benchmarks/r", convert = FALSE)
all_variants <- bench$load_variants()

# run.R's run_variant() without the record: build, warm up, EPOCHS timed epochs.
EPOCHS <- 2L  # the second holds the first's losses, as the runners do
r_peak <- function(built, v) {
  amp_gc()
  c <- census$Census()
  c$`__enter__`()
  run <- build_run(built, v)  # run.R's
  model <- run$model; opt <- run$opt; scaler <- run$scaler; step <- run$step; batches <- run$batches
  run <- NULL
  n <- length(batches)
  for (i in seq_len(py_to_r(v$warmup_steps(built$warmup_steps)))) {
    b <- batches[[(i - 1) %% n + 1]]
    step(b[[1]], b[[2]])
  }
  timed <- time_epochs(step, batches, EPOCHS)
  c$`__exit__`(NULL, NULL, NULL)
  model <- opt <- scaler <- step <- timed <- NULL
  amp_gc()
  py_to_r(c$peak_bytes)
}

cat(sprintf("%-16s %-11s %9s %9s %6s\n", "case", "variant", "py MiB", "R MiB", "R/Py"))
for (case in census_cases) {
  built <- bench$build_case(case, "cpu", seed = 0L, device = "cpu")
  for (name in census_variants) {
    v <- all_variants$`__getitem__`(name)
    py <- py_to_r(census$python_peak(built, v, EPOCHS))$peak_bytes
    r <- r_peak(built, v)
    cat(sprintf("%-16s %-11s %9.2f %9.2f %6.3f\n", case, name, py / 2^20, r / 2^20, r / py))
  }
}
