# Errors as R conditions of class c(<subclass>, "ampkit_error", "error",
# "condition"), with the offending value in the message.

ampkit_condition <- function(message, class = NULL, call = NULL, ...) {
  structure(
    class = c(class, "ampkit_error", "error", "condition"),
    list(message = message, call = call, ...)
  )
}

abort <- function(message, class = NULL, call = sys.call(-1), ...) {
  stop(ampkit_condition(message, class = class, call = call, ...))
}

# reticulate 1.28 raises Python exceptions as Rcpp exceptions; the exception
# type is in py_last_error().
is_py_error <- function(e) inherits(e, "Rcpp::exception")

py_error_condition <- function(e, context = NULL, call = NULL) {
  err <- tryCatch(reticulate::py_last_error(), error = function(e) NULL)
  type <- if (is.null(err) || is.null(err$type)) "Exception" else err$type
  full <- conditionMessage(e)
  # reticulate appends the Python traceback to the message; keep it in a
  # field and leave the message readable.
  msg <- trimws(sub("\\n *Detailed traceback:.*$", "", full))
  # "pkg.module.TypeName: text" -> "TypeName: text"
  msg <- paste0(type, ": ", sub(paste0("^[A-Za-z0-9_.]*", type, ": "), "", msg))
  ampkit_condition(
    paste0(if (!is.null(context)) paste0(context, ": "), "Python raised ", msg),
    class = c(paste0("ampkit_py_", type), "ampkit_python_error"),
    call = call, py_type = type, py_message = full, parent = e
  )
}

# Evaluate `expr`; a Python exception raised by it becomes an ampkit_error.
# R errors pass through untouched.
py_try <- function(expr, context = NULL) {
  withCallingHandlers(expr, error = function(e) py_rethrow(e, context))
}

py_rethrow <- function(e, context) {
  if (is_py_error(e)) {
    cond <- py_error_condition(e, context)
    if (is_oom(cond$py_type)) stop(oom_condition(cond, context))
    stop(cond)
  }
}

# An out-of-memory exception (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError):
# the Python bridge says which type names are.
is_oom <- function(type) {
  !is.null(type) && isTRUE(tryCatch(.h$is_out_of_memory(type),
                                    error = function(e) grepl("OutOfMemoryError$", type)))
}

# The bridge's calls retry once after an out-of-memory error (r_bridge.retry_call,
# which runs R's gc() through the collector set in py_ready()); the message of
# the second error says so.
oom_retried <- function(cond) grepl("[ampkit: out of memory again", cond$py_message %||% "", fixed = TRUE)

oom_condition <- function(cond, context) {
  retried <- oom_retried(cond)
  freed <- if (retried) NULL else free_memory()
  msg <- sprintf("%s: out of memory%s. %s Free memory (drop tensors you keep, use a smaller batch) or lower options(ampkit.gc_threshold_mb).\n%s",
                 context %||% "ampkit", if (retried) " twice" else "",
                 if (retried) "ampkit collected garbage (R's gc(), Python's gc, torch.cuda.empty_cache()) and retried the call once."
                 else sprintf("ampkit collected garbage (%.0f MiB freed); the call was not retried: R code ran in it.", freed),
                 cond$message)
  ampkit_condition(msg, class = c("ampkit_out_of_memory", setdiff(class(cond), c("ampkit_error", "error", "condition"))),
                   py_type = cond$py_type, py_message = cond$py_message, parent = cond)
}

`%||%` <- function(a, b) if (is.null(a)) b else a

# Call a Python function; its Python warnings become R warnings of class
# ampkit_python_warning (used where warnings matter, off the hot path).
py_call_warn <- function(fn, args, context) {
  res <- py_try(do.call(.h$call_warn, c(list(fn), args)), context)
  for (msg in unlist(res[[2]])) {
    warning(structure(class = c("ampkit_python_warning", "warning", "condition"),
                      list(message = paste0(context, ": ", msg), call = NULL)))
  }
  res[[1]]
}
