# The R runner's step for an fp8 variant, uncompiled, on the CPU (where fp8 runs through
# ampkit's emulation): two epochs of a case's tiny profile, one loss a line, after a first
# line with the record's note. test_bench_r.py compares them with the Python runner's.
#   Rscript tests/python/r_fp8_losses.R CASE VARIANT OUT
r_fp8_args <- commandArgs(trailingOnly = TRUE)
source("benchmarks/run.R")  # the R runner's functions, nothing run (device: cpu)
dataclasses <- reticulate::import("dataclasses", convert = FALSE)
v <- dataclasses$replace(reticulate::py_get_item(bench$load_variants(), r_fp8_args[[2]]), compile = "none")
built <- bench$build_case(r_fp8_args[[1]], "tiny", seed = 0L, device = "cpu")
run <- build_run(built, v)
losses <- numeric(0)
for (epoch in 1:2) {
  for (b in run$batches) losses <- c(losses, py_to_r(run$step(b[[1]], b[[2]])$item()))
}
writeLines(c(py_to_r(run$fp8$note), sprintf("%.17g", losses)), r_fp8_args[[3]])
run$fp8$scopes$remove()
