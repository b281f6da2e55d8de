# Skips that say what is missing, and small shared helpers.

repo_dir <- function() {
  repo <- Sys.getenv("AMPKIT_REPO")
  if (nzchar(repo) && dir.exists(file.path(repo, "shared_specs"))) normalizePath(repo) else ""
}

skip_if_no_ampkit <- function() {
  skip_if_not(ampkit::ampkit_available(),
              "Python with torch and ampkit not found (set RETICULATE_PYTHON to <repo>/.venv/bin/python; run `make setup`)")
}

skip_if_no_repo <- function() {
  skip_if_not(nzchar(repo_dir()), "AMPKIT_REPO (the repository, for shared_specs/) is not set")
}

skip_if_no_cuda <- function() {
  skip_if_no_ampkit()
  skip_if_not(ampkit::cuda_is_available(), "no CUDA device")
}

# Python torch, for building controls by hand in the tests.
pt <- function() reticulate::import("torch")

dtype_name <- function(t) sub("^torch\\.", "", reticulate::py_str(t$dtype))

# Run Python code in a fresh namespace and return that namespace as an R list
# (golden values computed by the Python core in the test, never pasted).
py_golden <- function(code) {
  ns <- reticulate::py_dict(list(), list(), convert = TRUE)
  reticulate::import_builtins()$exec(code, ns)
  reticulate::py_to_r(ns)
}

# Run Python code in a fresh namespace and return the namespace itself (not converted):
# functions defined there see its globals, and stay Python objects.
py_ns <- function(code) {
  ns <- reticulate::py_dict(list(), list(), convert = FALSE)
  reticulate::import_builtins(convert = FALSE)$exec(code, ns)
  ns
}

shape <- function(t) unlist(reticulate::import_builtins()$list(t$shape))

# How many calls into Python the hot path's crossing makes while `expr` runs: counted by
# the compiled crossing where it is in use, else through reticulate's call.
crossings <- function(expr) {
  status <- ampkit:::crossing_status
  if (status()$on) {
    status(reset = TRUE)
    force(expr)
    return(as.integer(status(reset = TRUE)$calls))
  }
  h <- ampkit:::.h
  raw <- h$call_raw
  withr::defer(h$call_raw <- raw)
  calls <- 0L
  h$call_raw <- function(f, args, kwargs) {
    calls <<- calls + 1L
    raw(f, args, kwargs)
  }
  force(expr)
  calls
}
