# Instructions the CPU runs for the seed's AMP step, by library, counted by callgrind:
# deterministic where timings on the shared 2-core VM move by 2x between runs. One run
# counts one loop (MODE: "r", the R loop through the package as installed; "reticulate",
# the same with the compiled crossing switched off; "bare", the step's seven calls as bare
# .External() crossings (bare_step.R): the floor of the package's R layer; "one", the whole step as one crossing into
# ampkit.r_bridge.amp_step (bare_step.R's one_crossing): the floor of an R loop; "py", its Python
# twin) over N steps
# after a warm-up, then the seed step's lines one by one (LINES=1):
#
#   R -d "valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg-r.out" \
#     --no-echo --no-restore -f benchmarks/r/instructions.R          # (with MODE=r N=100)
#   Rscript benchmarks/r/instructions.R summary 100 cg-r.out.1 ...   # per step, by library
#
# with RETICULATE_PYTHON, R_LIBS and OMP_NUM_THREADS=1 as for the other scripts here. The
# counting is switched on and off around each measured loop (callgrind_shim.R).
args <- commandArgs(trailingOnly = TRUE)
if (length(args) && args[[1]] == "summary") {
  n <- as.numeric(args[[2]])
  for (f in args[-(1:2)]) {
    out <- system2("callgrind_annotate", c("--threshold=100", f), stdout = TRUE)
    what <- sub(".*Client Request: ", "", grep("^Trigger: Client Request", out, value = TRUE))
    rows <- regmatches(out, regexec("^\\s*([0-9,]+) \\(.*\\[(.*)\\]\\s*$", out))
    rows <- Filter(function(r) length(r) == 3, rows)
    ir <- as.numeric(gsub(",", "", vapply(rows, `[[`, "", 2)))
    lib <- basename(vapply(rows, `[[`, "", 3))
    by <- tapply(ir, lib, sum) / n / 1000
    pick <- function(l) if (is.na(by[l])) 0 else by[[l]]
    cat(sprintf("%-22s %-10s all %7.1fK  R %6.1fK  Python %6.1fK  torch %6.1fK  libc %6.1fK  ampkit %5.1fK  reticulate+Rcpp %5.1fK\n",
                basename(f), what, sum(by), pick("libR.so"), sum(by[grepl("^libpython", names(by))]),
                pick("libtorch_cpu.so"), pick("libc.so.6"), pick("ampkit.so"),
                pick("reticulate.so") + pick("Rcpp.so")))
  }
  quit(save = "no")
}

source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "callgrind_shim.R"))  # counted()

library(ampkit)
stopifnot(ampkit_available())
torch <- reticulate::import("torch")
torch$set_num_threads(1L)
mode <- Sys.getenv("MODE", "r")
n <- as.integer(Sys.getenv("N", "100"))
if (mode == "reticulate") ampkit:::use_crossing(FALSE)
source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))  # data ... scaler, step(i)
r_loop <- function(n) for (s in seq_len(n)) step((s - 1L) %% 10L + 1L)
py <- reticulate::py_run_string("
from ampkit.r_bridge import amp_step
def py_loop(net, loss_fn, opt, scaler, data, targets, n):
    for s in range(n):
        amp_step(net, loss_fn, opt, scaler, data[s % 10], targets[s % 10], 'cpu')
", convert = FALSE)
twin <- list(attr(net, "py_object"), attr(loss_fn, "py_object"), reticulate::r_to_py(opt), scaler$py,
             reticulate::r_to_py(data), reticulate::r_to_py(targets))
if (mode == "bare") {
  source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "bare_step.R"))  # bare_step(i)
  r_loop <- function(n) for (s in seq_len(n)) bare_step((s - 1L) %% 10L + 1L)
}
if (mode == "one") {
  source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "bare_step.R"))  # one_crossing(i)
  r_loop <- function(n) for (s in seq_len(n)) one_crossing((s - 1L) %% 10L + 1L)
}
loop <- if (mode == "py") function(n) do.call(py$py_loop, c(twin, list(as.integer(n)))) else r_loop
loop(50L)
counted(mode, loop, n)

if (!mode %in% c("py", "bare", "one") && Sys.getenv("LINES", "1") == "1") {
  x <- data[[1]]
  y <- targets[[1]]
  output <- net(x)
  repeated <- function(f) function(n) for (i in seq_len(n)) f()
  lines <- list(
    region = function() with_autocast(device_type = "cpu", NULL),
    net = function() net(x),
    loss = function() loss_fn(output, y),
    backward_input = function() loss_fn(net(x), y),
    backward = function() scaler$scale(loss_fn(net(x), y))$backward(),
    step_update = function() {
      scaler$step(opt)
      scaler$update()
    },
    zero_grad = function() opt$zero_grad())
  for (name in names(lines)) {
    f <- repeated(lines[[name]])
    f(50L)
    counted(name, f, n)
  }
}
