# One torch thread on the 2-core machine, set once for the whole run.
if (ampkit::ampkit_available()) {
  reticulate::import("torch")$set_num_threads(1L)
}

# Quiet torch's deprecation notes for old op spellings that the spec tests
# call on purpose, and the core's "CUDA is not available" note on the CPU.
if (ampkit::ampkit_available()) {
  reticulate::py_run_string(paste(
    "import warnings",
    "warnings.filterwarnings('ignore', message='.*deprecated')",
    "warnings.filterwarnings('ignore', message='.*CUDA is not available')",
    "warnings.filterwarnings('ignore', message='.*not as a CUDA graph')",
    sep = "\n"))
}
