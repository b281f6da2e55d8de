# What R's own call machinery costs on the objects of the seed's step, in instructions
# counted by callgrind (deterministic), per call: `$` on an environment with a class
# attribute and no `$` method (the R6 scaler: R still dispatches, and fails), the same
# with a registered `$` method (a closure; the builtin .subset2), on a plain environment;
# the step's lookups (scaler$step, opt$zero_grad, scaler$scale(loss)$backward); a closure
# with `...` around the compiled module call (net(x) against its bare .External); and
# with_autocast()'s signature (seven formals, `...`, a name after it) against two formals.
# Each row is a loop of N calls less an empty loop.
#
#   R -d "valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg-cost.out" \
#     --no-echo --no-restore -f benchmarks/r/call_costs.R
#   for f in cg-cost.out.*; do grep -m1 Trigger $f; grep -m1 ^totals $f; done
#
# with RETICULATE_PYTHON, R_LIBS, OMP_NUM_THREADS=1 and AMPKIT_REPO as for the other
# scripts here. Rows that call Python (net, net_bare) include its instructions: compare
# them with each other only.
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "callgrind_shim.R"))  # counted()
library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)
for (i in 1:20) step(1L)
n <- as.integer(Sys.getenv("N", "100"))
classed <- function(cls) {
  e <- new.env()
  e$f <- function(x) x
  class(e) <- cls
  e
}
r6_like <- classed(c("ampkit_grad_scaler", "R6"))
plain <- new.env()
plain$f <- function(x) x
with_closure <- classed("call_costs_closure")
registerS3method("$", "call_costs_closure", function(x, name) .subset2(x, name))
with_builtin <- classed(c("call_costs_builtin", "R6"))
registerS3method("$", "call_costs_builtin", .subset2)
x <- data[[1]]
y <- targets[[1]]
loss <- loss_fn(net(x), y)
x_ <- ampkit:::.x
net_py <- attr(net, "py_object")
ns <- asNamespace("ampkit")
signature <- function(f) compiler::cmpfun(`environment<-`(f, ns))  # byte code, as installed
seven <- signature(function(code, ..., device_type, dtype = NULL, enabled = TRUE, cache_enabled = NULL,
                            policy = NULL) NULL)
two <- signature(function(code, device_type) NULL)
loops <- list(
  empty = function(n) for (i in seq_len(n)) NULL,
  dollar_classed_no_method = function(n) for (i in seq_len(n)) r6_like$f,
  dollar_closure_method = function(n) for (i in seq_len(n)) with_closure$f,
  dollar_builtin_method = function(n) for (i in seq_len(n)) with_builtin$f,
  dollar_plain = function(n) for (i in seq_len(n)) plain$f,
  scaler_step = function(n) for (i in seq_len(n)) scaler$step,
  opt_zero_grad = function(n) for (i in seq_len(n)) opt$zero_grad,
  scaler_scale_loss = function(n) for (i in seq_len(n)) scaler$scale(loss),
  scaler_scale_loss_backward = function(n) for (i in seq_len(n)) scaler$scale(loss)$backward,
  signature_seven = function(n) for (i in seq_len(n)) seven(device_type = "cpu", NULL),
  signature_two = function(n) for (i in seq_len(n)) two(device_type = "cpu", NULL),
  net = function(n) for (i in seq_len(n)) net(x),
  net_bare = function(n) for (i in seq_len(n)) .External(x_$module, net_py, x)
)
for (name in names(loops)) {
  loops[[name]](20L)
  counted(name, loops[[name]], n)
}
