# One torch thread on the 2-core machine, set once for the whole run.
if (ampkit::ampkit_available()) {
  reticulate::import("torch")$set_num_threads(1L)
}
