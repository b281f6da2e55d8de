# Whether R's garbage collector explains the R layer's cost inside the seed's step: the
# collections R makes (counted from gcinfo()'s reports) and the CPU time per step of the
# step as written, the bare crossings and the one crossing (step_layers.R's loops), in one
# process, interleaved.
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<lib> OMP_NUM_THREADS=1 AMPKIT_REPO=<repo> \
#     Rscript benchmarks/r/step_gc.R [steps=4000] [rounds=2]
#
# R keeps no count of its collections: gcinfo(TRUE) reports each one on the message
# stream, which is diverted to a file while a loop runs, and its lines counted.
library(ampkit)
stopifnot(ampkit_available())
args <- as.integer(commandArgs(trailingOnly = TRUE))
steps <- if (length(args) >= 1 && !is.na(args[[1]])) args[[1]] else 4000L
rounds <- if (length(args) >= 2 && !is.na(args[[2]])) args[[2]] else 2L
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "bare_step.R"))  # x_ ... bare_step(i), one_crossing(i)
loops <- list(step = step, bare = bare_step, one_crossing = one_crossing)
probe <- function(name) {
  f <- loops[[name]]
  for (s in 1:100) f((s - 1L) %% 10L + 1L)
  log_file <- tempfile()
  con <- file(log_file, "w")
  sink(con, type = "message")
  old <- gcinfo(TRUE)
  t <- system.time(for (s in seq_len(steps)) f((s - 1L) %% 10L + 1L))
  gcinfo(old)
  sink(type = "message")
  close(con)
  c(us = (t[["user.self"]] + t[["sys.self"]]) / steps * 1e6,
    collections = sum(grepl("^Garbage collection", readLines(log_file))))
}
res <- NULL
for (r in seq_len(rounds)) for (name in names(loops)) res <- rbind(res, data.frame(loop = name, round = r, t(probe(name))))
cat(sprintf("CPU us per step and R's garbage collections in each round of %d steps\n", steps))
print(res, row.names = FALSE)
