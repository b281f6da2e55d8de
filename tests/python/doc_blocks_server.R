# Runs the R blocks of the docs for tests/python/test_doc_blocks.py, each in a fork of
# one R process that has loaded (not attached) ampkit and started its Python: a block
# then costs its own run time, not R's, reticulate's and torch's start-up (about 10 s
# each on two cores). A block still needs its own library(ampkit).
#
# Protocol, one request a line on stdin: "<block.R>\t<output file>\t<working folder>\t<seconds>";
# one answer a line on stdout: the block's exit status (0: it ran without an error; 124:
# killed after <seconds>).
# The block's printed values, messages, warnings and error go to the output file.

invisible(loadNamespace("ampkit"))
stopifnot(ampkit::ampkit_available())

run_block <- function(script, output, folder) {
  out <- file(output, open = "wt")
  sink(out)
  sink(out, type = "message")
  setwd(folder)
  status <- tryCatch(
    withCallingHandlers({
      # print.eval: values print as they do at Rscript's top level
      source(script, local = new.env(parent = globalenv()), echo = FALSE, print.eval = TRUE)
      0L
    }, warning = function(w) {
      message("Warning: ", conditionMessage(w))
      invokeRestart("muffleWarning")
    }),
    error = function(e) {
      message("Error: ", conditionMessage(e))
      1L
    })
  sink(type = "message")
  sink()
  close(out)
  status
}

input <- file("stdin")
open(input)
while (length(line <- readLines(input, n = 1)) > 0) {
  request <- strsplit(line, "\t", fixed = TRUE)[[1]]
  job <- parallel::mcparallel(run_block(request[1], request[2], request[3]))
  status <- parallel::mccollect(job, wait = FALSE, timeout = as.numeric(request[4]))
  if (is.null(status)) {
    tools::pskill(job$pid, tools::SIGKILL)
    parallel::mccollect(job)
    status <- 124L
  } else {
    status <- status[[1]]
  }
  cat(if (is.integer(status)) status else 1L, "\n", sep = "")
  flush(stdout())
}
