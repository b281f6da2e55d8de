# Counting the calls R makes into reticulate's C++ layer: trace every function of
# reticulate whose body makes a `.Call` (Python calls, attribute lookups, conversions),
# plus any names in `extra` (e.g. "r_to_py"). Source it, then call trace_reticulate()
# before library(ampkit) binds any of them; the counts go to the global environment
# `.cnt` (the tracers find it by name from reticulate's namespace), which it returns.
trace_reticulate <- function(extra = character()) {
  assign(".cnt", new.env(), envir = globalenv())
  ns <- asNamespace("reticulate")
  dot_calls <- Filter(function(k) {
    v <- get(k, ns)
    is.function(v) && any(grepl(".Call(", deparse(body(v)), fixed = TRUE))
  }, ls(ns, all.names = TRUE))
  for (k in c(dot_calls, extra)) {
    .cnt[[k]] <- 0
    suppressMessages(trace(k, tracer = bquote(.cnt[[.(k)]] <- .cnt[[.(k)]] + 1), where = ns, print = FALSE))
  }
  .cnt
}
