# ---- the compiled crossing (src/crossing.c)
#
# reticulate 1.28 costs 30-150 us a call into Python from R; the C API call it makes
# costs a few. The hot path's crossing (.h$call_raw(f, args, kwargs), through which every
# call of a training step goes: regions, module and loss calls, the scaler's and the
# optimizer's per-step calls) is made by the package's own compiled code when it loaded,
# on the objects reticulate holds, in its interpreter, with the same results (objects of
# reticulate's form and classes) and the same R conditions (a Python exception is
# raised again through reticulate). Everything else stays on reticulate.
#
# Off, or where it cannot load (the package was installed without a C compiler, the
# Python's library cannot be found), the crossing is reticulate's py_call_impl(), as
# before; one message says why, when Python starts. AMPKIT_R_COMPILED=0 (at install or
# at run time) or options(ampkit.compiled = FALSE) before Python starts turns it off.

.x <- new.env(parent = emptyenv())
.x$dll <- NULL      # the loaded DLL, or NULL
.x$why <- NULL      # why it is off (NULL: on, or not decided yet)
.x$on <- FALSE      # whether the hot path crosses through it now

# In .onLoad: load the DLL when there is one and the crossing is not turned off.
load_crossing <- function(libname, pkgname) {
  if (!crossing_wanted()) {
    .x$why <- "turned off (AMPKIT_R_COMPILED=0 or options(ampkit.compiled = FALSE))"
    return(invisible(FALSE))
  }
  .x$dll <- tryCatch(library.dynam(pkgname, pkgname, libname), error = function(e) {
    .x$why <- if (grepl("shared object .* not found", conditionMessage(e))) {
      "the package was installed without it: no working C compiler at install, or AMPKIT_R_COMPILED=0"
    } else {
      paste("its shared object did not load:", conditionMessage(e))
    }
    NULL
  })
  invisible(!is.null(.x$dll))
}

crossing_wanted <- function() {
  Sys.getenv("AMPKIT_R_COMPILED", "1") != "0" && !identical(getOption("ampkit.compiled"), FALSE)
}

# In py_ready(), Python started: resolve Python's C API in the libpython reticulate loaded
# and make the compiled crossing the hot path's. Returns whether it is on.
start_crossing <- function() {
  if (is.null(.x$why) && !crossing_wanted()) {
    .x$why <- "turned off (AMPKIT_R_COMPILED=0 or options(ampkit.compiled = FALSE))"
  }
  if (is.null(.x$why) && !is.null(.x$dll)) {
    routine <- function(name) getNativeSymbolInfo(name, .x$dll)$address
    got <- tryCatch({
      lib <- reticulate::py_config()$libpython
      ok <- .Call(routine("ampkit_init"), if (is.null(lib)) NA_character_ else lib,
                  list(reticulate::py_eval("None", convert = FALSE), .h$reticulate_call,
                       .h$reticulate_to_r, reticulate::py_to_r, .pend, py_rethrow_or_stop,
                       callx_fallback, NULL))
      if (identical(ok, "")) {
        .Call(routine("ampkit_release_setup"), .rel,
              c(RELEASE_KEEP, RELEASE_KEPT, RELEASE_EVERY, RELEASE_EVERY_MAX),
              list(module_fallback, reticulate::py_to_r, .h$fn$call_releasing))
        .x$call <- routine("ampkit_call")
        .x$to_r <- routine("ampkit_to_r")
        .x$callx <- routine("ampkit_callx")
        .x$module <- routine("ampkit_module")
        .Call(routine("ampkit_region_setup"),
              list(.h$fn$enter_autocast, .h$fn$exit_autocast, region_error, region_options, force_code))
        .x$region <- routine("ampkit_region")
        .x$region_code <- routine("ampkit_region_code")
        .x$scaled_loss <- routine("ampkit_scaled_loss")
        .Call(routine("ampkit_scaler_setup"),
              list(scaled_tensor, watch_memory, .mem, routine("ampkit_scaled_backward")))
        .x$scale <- routine("ampkit_scale")
        .x$backward_function <- routine("ampkit_backward_function")
        .x$scaler_step <- routine("ampkit_scaler_step")
        .x$zero_grad <- routine("ampkit_zero_grad")
        .x$scaled_done <- routine("ampkit_scaled_done")
        .x$defer_update <- routine("ampkit_defer_update")
        .x$compiled_methods <- routine("ampkit_compiled_methods")
        .x$forget <- routine("ampkit_release_forget")
        .x$collecting <- routine("ampkit_release_collecting")
        .x$calibrated <- routine("ampkit_release_calibrated")
      }
      ok
    }, error = function(e) conditionMessage(e))
    if (!identical(got, "")) .x$why <- paste("it could not start:", got)
  } else if (is.null(.x$why)) {
    .x$why <- "its shared object was not loaded"
  }
  use_crossing(is.null(.x$why))
}

# The hot path's crossing: compiled (`on`) or reticulate's. Tests switch it to compare.
use_crossing <- function(on) {
  on <- isTRUE(on) && !is.null(.x$call) && is.null(.x$why)
  if (on) {
    call <- .x$call
    to_r <- .x$to_r
    .h$call_raw <- function(f, args, kwargs) .Call(call, f, args, kwargs)
    .h$to_r <- function(x) .Call(to_r, x)
  } else {
    .h$call_raw <- .h$reticulate_call
    .h$to_r <- .h$reticulate_to_r
    if (!is.null(.x$forget)) .Call(.x$forget, FALSE)
    if (!is.null(.x$why) && !isTRUE(.x$told) && !grepl("^turned off", .x$why)) {
      .x$told <- TRUE
      packageStartupMessage("ampkit: the compiled crossing into Python is not in use (", .x$why,
                            "). Calls go through reticulate, which is slower.")
    }
  }
  .x$on <- on
  # what an output held by nothing but its slot reads, through this crossing (memory.R)
  calibrate_release()
  invisible(on)
}

# Whether the hot path crosses through the compiled code (tests, benchmarks), and why not;
# with the counts of the compiled crossing: calls into Python so far, seconds spent in
# Python in them, Python classes whose R class vector is cached (`reset`: count calls and
# seconds again), dropped outputs whose Python reference was let go (src/module.c).
crossing_status <- function(reset = FALSE) {
  counts <- if (is.null(.x$dll)) c(0, 0, 0) else
    .Call(getNativeSymbolInfo("ampkit_crossing_stats", .x$dll)$address, isTRUE(reset))
  let_go <- if (is.null(.x$dll)) 0 else .Call(getNativeSymbolInfo("ampkit_release_counts", .x$dll)$address)
  list(on = isTRUE(.x$on), why = .x$why, calls = counts[[1]], seconds_in_python = counts[[2]],
       classes = counts[[3]], let_go = let_go)
}

# The result conversions of .External(.x$callx, context, mode, f, ...) (src/crossing.c).
CALLX_REF <- 0L      # reticulate's object
CALLX_TO_R <- 1L     # .h$to_r() of it (a plain value)
CALLX_VALUE <- 2L    # py_value() of it
CALLX_NOTHING <- 3L  # NULL

# A call of .External(.x$callx, ...) whose arguments the compiled crossing does not
# convert: the R path, through reticulate for those arguments.
callx_fallback <- function(context, mode, f, args) {
  nm <- names(args)
  named <- if (is.null(nm)) logical(length(args)) else nzchar(nm) & !is.na(nm)
  pos <- py_args(unname(args[!named]))
  kw <- if (any(named)) py_args(args[named]) else NULL
  run <- function() {
    res <- .h$call(f, pos, kw)
    switch(mode + 1L, res, .h$to_r(res), py_value(res), NULL)
  }
  if (is.null(context)) run() else py_try(run(), context)
}

# The compiled crossing's error with a context (src/crossing.c): the package's condition
# for a Python exception, as py_try() makes it; any other error as it is.
py_rethrow_or_stop <- function(e, context) {
  py_rethrow(e, context)
  stop(e)
}
