# Shared state for the whole run, undone in teardown_env().
if (ampkit::ampkit_available()) {
  local({
    torch <- reticulate::import("torch")
    threads <- torch$get_num_threads()
    # one torch thread on the 2-core machine
    torch$set_num_threads(1L)
    # quiet torch's deprecation notes for the old op spellings that the spec
    # tests call on purpose, and the core's CUDA notes on the CPU
    warnings <- reticulate::import("warnings")
    saved <- reticulate::py_eval("__import__('warnings').filters[:]", convert = FALSE)
    warnings$filterwarnings("ignore", message = ".*deprecated")
    warnings$filterwarnings("ignore", message = ".*CUDA is not available")
    warnings$filterwarnings("ignore", message = ".*not as a CUDA graph")
    withr::defer({
      torch$set_num_threads(threads)
      reticulate::py_set_attr(warnings, "filters", saved)
    }, teardown_env())
  })
}
