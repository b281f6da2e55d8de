#' ampkit: automatic mixed precision for PyTorch from R
#'
#' The R face of the ampkit Python core: [with_autocast()] and
#' [local_autocast()] for autocast regions, [amp_grad_scaler()] for loss
#' scaling, [amp_policy()] and [amp_trace()] to read, change and trace cast
#' policies, and a thin layer of torch constructors ([nn_linear()],
#' [optim_sgd()], ...) so that AMP code written for the R torch package runs
#' as written.
#'
#' Python is found by reticulate: `RETICULATE_PYTHON` if set (as `make setup`
#' and `make test` do), else the virtual environment that [install_ampkit()]
#' made. It is started on first use, not when the package loads.
#'
#' The calls a training step makes into Python (regions, module and loss calls, the
#' scaler's and the optimizer's per-step calls) go through the package's compiled code,
#' on the objects reticulate holds, with the same results and conditions as through
#' reticulate; everything else goes through reticulate. A package installed without a
#' C compiler, or a Python whose C API is not found, calls through reticulate instead
#' (slower), and says so once when Python starts. `AMPKIT_R_COMPILED=0` (at install or at
#' run time) or `options(ampkit.compiled = FALSE)` before Python starts turns the compiled
#' code off.
#'
#' @keywords internal
#' @importFrom R6 R6Class
"_PACKAGE"

# Python modules, delay-loaded in .onLoad (keras3/tensorflow style): the
# package loads without Python and Python starts on first use.
py_ampkit <- NULL
py_torch <- NULL

# Cached Python handles (bound functions) for the hot paths; filled on first
# use by h(), so that a training step does no `$` lookups of its own.
.h <- new.env(parent = emptyenv())

.onLoad <- function(libname, pkgname) {
  on_error <- function(e) {
    stop(ampkit_condition(missing_python_message(conditionMessage(e)),
                          class = "ampkit_python_missing"))
  }
  use_ampkit_env()
  load_crossing(libname, pkgname)
  lazy <- list(before_load = python_startup, on_error = on_error)
  py_ampkit <<- reticulate::import("ampkit", delay_load = lazy)
  py_torch <<- reticulate::import("torch", delay_load = lazy)
}

# What the embedded Python needs before torch is imported (see below).
python_startup <- function() {
  keep_torch_blas()
  find_python_headers()
}

# R has loaded Debian's reference BLAS (libblas.so.3) before Python starts, and
# a torch loaded afterwards binds its float32 matmuls to R's sgemm instead of
# its own: 15-20x slower on the CPU, with other rounding (a 512x1024x1024
# matmul took 917 ms from R against 54 ms from Python; 61 ms with this).
# Loading Python extensions with RTLD_DEEPBIND keeps torch's own symbols. It
# must run before torch is imported; AMPKIT_R_DEEPBIND=0 turns it off.
keep_torch_blas <- function() {
  if (Sys.getenv("AMPKIT_R_DEEPBIND", "1") == "0") return(invisible(FALSE))
  reticulate::py_run_string(paste(
    "import os, sys",
    "if 'torch' not in sys.modules and hasattr(os, 'RTLD_DEEPBIND'):",
    "    sys.setdlopenflags(sys.getdlopenflags() | os.RTLD_DEEPBIND)",
    sep = "\n"), convert = FALSE)
  invisible(TRUE)
}

# reticulate starts a virtual environment's Python with sys.base_prefix set to the
# environment, so sysconfig's include path is <venv>/include/pythonX.Y, where there are
# no headers: C++ compiled at run time fails with "Python.h: No such file or directory"
# (torch.compile on the CPU: inductor's kernels include Python.h). The interpreter's
# own INCLUDEPY has them: it goes on CPATH, which gcc and clang read, for the compilers
# that Python starts from now on.
find_python_headers <- function() {
  reticulate::py_run_string(paste(
    "import os, sysconfig",
    "_inc, _real = sysconfig.get_path('include'), sysconfig.get_config_var('INCLUDEPY')",
    "if (_real and not os.path.exists(os.path.join(_inc, 'Python.h'))",
    "        and os.path.exists(os.path.join(_real, 'Python.h'))",
    "        and _real not in os.environ.get('CPATH', '').split(os.pathsep)):",
    "    os.environ['CPATH'] = os.pathsep.join(p for p in (os.environ.get('CPATH'), _real) if p)",
    "del _inc, _real",
    sep = "\n"), convert = FALSE)
  invisible(TRUE)
}

# What is missing, and how to get it: named in every "no Python" error and in
# ampkit_available()'s message. It names the Python reticulate found, since the usual
# cause is reticulate finding another Python than the one with torch and ampkit.
missing_python_message <- function(detail = NULL) {
  what <- tryCatch({
    if (!reticulate::py_available(initialize = TRUE)) {
      "no Python was found"
    } else if (!reticulate::py_module_available("torch")) {
      sprintf("reticulate found the Python at %s, which has no `torch`", reticulate::py_exe())
    } else if (!reticulate::py_module_available("ampkit")) {
      sprintf("reticulate found the Python at %s, which has no `ampkit` Python package", reticulate::py_exe())
    } else {
      sprintf("importing torch and ampkit in the Python at %s failed", reticulate::py_exe())
    }
  }, error = function(e) paste("Python could not be started:", conditionMessage(e)))
  started <- tryCatch(reticulate::py_available(initialize = FALSE), error = function(e) FALSE)
  paste0(
    "ampkit needs Python with `torch` and the `ampkit` Python package, but ", what, ".\n",
    "Run ampkit::install_ampkit(\"<path of the ampkit repository or wheel>\") and restart R ",
    "(or, in the repository, `make setup` and Sys.setenv(RETICULATE_PYTHON = \"<repo>/.venv/bin/python\") ",
    "before the first use of ampkit).\n",
    "To point reticulate at a Python that has both, set Sys.setenv(RETICULATE_PYTHON = \"/path/to/bin/python\") ",
    "or call reticulate::use_python(\"/path/to/bin/python\") before the first use of ampkit",
    if (started) " (Python has started in this R session: restart R first)." else ".",
    if (!is.null(detail) && nzchar(detail)) paste0("\nCause: ", detail)
  )
}

#' Is the ampkit Python core usable?
#'
#' `ampkit_available()` tells whether Python, torch and the ampkit Python
#' package can be loaded, without raising an error. Use it to guard examples
#' and scripts that need Python. When it returns `FALSE` it says why in a
#' message: the Python reticulate found, what it lacks (`torch` or `ampkit`),
#' and how to point reticulate at the right one (`RETICULATE_PYTHON` or
#' [reticulate::use_python()] before the first use, or [install_ampkit()]).
#' `suppressMessages(ampkit_available())` asks quietly.
#' `ampkit_config()` describes the Python in use.
#'
#' @return `ampkit_available()`: `TRUE` or `FALSE`. `ampkit_config()`: a list
#'   with the Python executable and the versions of torch and ampkit.
#' @export
#' @examples
#' if (ampkit_available()) {
#'   ampkit_config()
#' }
ampkit_available <- function() {
  isTRUE(tryCatch({
    py_ready()
    TRUE
  }, error = function(e) {
    message(conditionMessage(e))
    FALSE
  }))
}

#' @rdname ampkit_available
#' @export
ampkit_config <- function() {
  py_ready()
  list(
    python = reticulate::py_exe(),
    torch = py_torch$`__version__`,
    ampkit = py_ampkit$`__version__`,
    cuda = .h$cuda_is_available()
  )
}

# Import the modules (once) and cache the handles the hot paths use.
py_ready <- function() {
  if (!is.null(.h$ready)) return(invisible(TRUE))
  if (!reticulate::py_available(initialize = FALSE) &&
      nzchar(Sys.getenv("RETICULATE_PYTHON")) &&
      !file.exists(Sys.getenv("RETICULATE_PYTHON"))) {
    stop(ampkit_condition(missing_python_message(sprintf(
      "RETICULATE_PYTHON=%s does not exist", Sys.getenv("RETICULATE_PYTHON"))),
      class = "ampkit_python_missing"))
  }
  ok <- tryCatch({
    python_startup()  # before py_module_available(), which imports the module
    reticulate::py_module_available("ampkit") && reticulate::py_module_available("torch")
  }, error = function(e) FALSE)
  if (!ok) {
    stop(ampkit_condition(missing_python_message(), class = "ampkit_python_missing"))
  }
  bridge <- tryCatch(reticulate::import("ampkit.r_bridge"), error = function(e) {
    stop(ampkit_condition(missing_python_message(conditionMessage(e)), class = "ampkit_python_missing"))
  })
  # Bound once: each call of the hot path is then one crossing, without `$` lookups.
  # Results are converted (None -> NULL, floats -> numbers: no wrapper for R to
  # collect); tensors stay Python objects.
  for (name in c("enter_autocast", "exit_autocast", "call_method", "retry_call", "is_method",
                 "policy", "load_scaler_state", "check_autocast", "trace_rows", "plain",
                 "call_warn", "open_regions", "memory_allocated", "cuda_total_memory",
                 "set_memory_reader", "collect_garbage", "live_tensor_count",
                 "is_out_of_memory", "policy_names", "scaler_int_state_keys", "ScalerCalls",
                 "bound_zero_grad", "is_torch_function")) {
    assign(name, bridge[[name]], envir = .h)
  }
  # The hot path's crossings (see py_arg() below): the compiled crossing (crossing.R), or
  # reticulate's own call without the R closure around it; the bridge's functions as
  # Python objects.
  .h$reticulate_call <- utils::getFromNamespace("py_call_impl", "reticulate")
  .h$reticulate_to_r <- utils::getFromNamespace("py_ref_to_r", "reticulate")  # a plain value, no dispatch
  .h$call <- py_call
  .h$fn <- lapply(list(enter_autocast = "enter_autocast", exit_autocast = "exit_autocast",
                       call_method = "call_method", call_releasing = "call_releasing",
                       release_tensors = "release_tensors", update_then = "update_then"),
                  function(n) py_fn(bridge[[n]]))
  start_crossing()  # (calibrates the release through the crossing in use)
  # An out-of-memory error in Python runs R's gc() before the retry.
  py_reset_collector()
  .h$named_parameters <- reticulate::py_eval("lambda m: dict(m.named_parameters())")
  .h$cuda_is_available <- py_torch$cuda$is_available
  .h$ready <- TRUE
  invisible(TRUE)
}

# R's collector for the bridge's out-of-memory retry (r_bridge.retry_call).
py_reset_collector <- function() {
  reticulate::import("ampkit.r_bridge")$set_r_collector(function() {
    forget_outputs()
    gc(full = TRUE)
    invisible(NULL)
  })
}

# ---- the hot path's crossings
#
# reticulate 1.28 calls a Python function from R through an R closure that splits
# `...`, calls py_call_impl() and converts the result (py_to_r() dispatch), and it
# sends every argument that has a class through R's r_to_py() dispatch (15-30 us
# an argument on a small CPU, as much as the call itself). The hot path calls
# py_call_impl() directly and passes Python objects in an unclassed carrier whose
# `py_object` attribute reticulate's C++ conversion takes as the object itself.

# Every call the package makes into Python on the hot path: py_call_impl(), after
# the scaler update that `$update()` deferred, if any, in the same crossing
# (r_bridge.update_then; scaler.R says why it is deferred).
py_call <- function(f, args, kwargs) {
  u <- .pend$update
  if (is.null(u)) return(.h$call_raw(f, args, kwargs))
  .pend$update <- NULL
  .h$call_raw(.h$fn$update_then, c(list(u, py_arg(f)), args), kwargs)
}

# A deferred update, run now (in its own crossing): before any read of a scaler's state
# that does not go through py_call().
flush_update <- function() {
  u <- .pend$update
  if (is.null(u)) return(invisible(NULL))
  .pend$update <- NULL
  py_try(.h$call_raw(.h$fn$update_then, list(u, NULL), NULL), "$update()")
  invisible(NULL)
}

# The scaler update deferred by `$update()`: a carrier of its Python callable, or NULL.
.pend <- new.env(parent = emptyenv())

# A logical option that is on unless set to FALSE. (getOption() with a default builds
# the list of all options, a few microseconds each time.)
option_on <- function(name) {
  v <- getOption(name)
  is.null(v) || isTRUE(v)
}

# The Python object of a callable (reticulate wraps callables in R closures).
py_fn <- function(f) if (is.function(f)) attr(f, "py_object") else f

#
# The carrier points to a new environment holding reticulate's external pointer, not
# to the R object itself: a carrier left for R's collector then adds nothing to the R
# object's reference count, which the release of dropped outputs reads (memory.R).
# It is kept in the object's own environment (reticulate's objects are environments),
# so that an object passed every step (a batch, the optimizer) is wrapped once; the
# binding points from the object to the carrier, which adds nothing to that count either.
py_arg <- function(x) {
  if (is.object(x) && inherits(x, "python.builtin.object")) {
    if (is.function(x)) x <- attr(x, "py_object")
    carrier <- .subset2(x, ".ampkit_arg")
    if (!is.null(carrier)) return(carrier)
    ref <- new.env(parent = emptyenv(), size = 2L)
    ref$pyobj <- .subset2(x, "pyobj")
    ref$convert <- .subset2(x, "convert")
    carrier <- list()
    attr(carrier, "py_object") <- ref  # (structure() costs twice as much)
    if (is.environment(x)) assign(".ampkit_arg", carrier, envir = x)
    carrier
  } else {
    x
  }
}

py_args <- function(args) {
  for (k in seq_along(args)) if (is.object(args[[k]])) args[k] <- list(py_arg(args[[k]]))
  args
}

# The unnamed and the named arguments of `...`, as carriers, read one by one with
# ...elt(): a list(...) would hold the R objects (and count as a reference to them)
# until R collects it.
dot_args <- function(...) {
  n <- ...length()
  if (!n) return(list())
  nm <- ...names()
  if (is.null(nm)) {  # the common calls, net(x) and loss_fn(output, y), without a loop
    if (n == 1L) return(list(py_arg(..1)))
    if (n == 2L) return(list(py_arg(..1), py_arg(..2)))
  }
  pos <- if (is.null(nm)) seq_len(n) else which(!nzchar(nm) | is.na(nm))
  args <- vector("list", length(pos))
  for (k in seq_along(pos)) args[k] <- list(py_arg(...elt(pos[[k]])))
  args
}

dot_keywords <- function(...) {
  nm <- ...names()
  if (is.null(nm)) return(NULL)
  at <- which(nzchar(nm) & !is.na(nm))
  if (!length(at)) return(NULL)
  kw <- vector("list", length(at))
  for (k in seq_along(at)) kw[k] <- list(py_arg(...elt(at[[k]])))
  names(kw) <- nm[at]
  kw
}

# A result as reticulate's converting call returns it; tensors (which do not
# convert) and None (an optimizer step's result) skip py_to_r()'s dispatch.
py_value <- function(res) {
  if (inherits(res, "torch.Tensor")) res
  else if (inherits(res, "python.builtin.NoneType")) NULL
  else reticulate::py_to_r(res)
}
