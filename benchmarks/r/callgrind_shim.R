# counted(name, f, n): f(n) with callgrind's counting on, dumped under `name` (callgrind's
# client requests, a few lines of C built here with R CMD SHLIB; valgrind's headers
# needed). Sourced by instructions.R and call_costs.R, run under
#   R -d "valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out" ...
shim <- file.path(tempdir(), "cg.c")
writeLines(c("#include <valgrind/callgrind.h>", "#include <Rinternals.h>",
             "SEXP cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; return R_NilValue; }",
             "SEXP cg_stop(SEXP name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(CHAR(STRING_ELT(name, 0))); return R_NilValue; }"),
           shim)
stopifnot(system2(file.path(R.home("bin"), "R"), c("CMD", "SHLIB", shim), stdout = FALSE) == 0)
dll <- dyn.load(sub("\\.c$", .Platform$dynlib.ext, shim))
counted <- function(name, f, n) {
  .Call(getNativeSymbolInfo("cg_start", dll)$address)
  f(n)
  .Call(getNativeSymbolInfo("cg_stop", dll)$address, name)
}
