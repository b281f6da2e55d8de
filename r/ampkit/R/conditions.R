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
  # A CUDA out-of-memory error: free what R garbage holds first (memory.R).
  if (is_oom(type)) msg <- paste(c(msg, oom_note()), collapse = "\n")
  ampkit_condition(
    paste0(if (!is.null(context)) paste0(context, ": "), "Python raised ", msg),
    class = c(paste0("ampkit_py_", type), "ampkit_python_error"),
    call = call, py_type = type, py_message = full, parent = e
  )
}

# Evaluate `expr`; a Python exception raised by it becomes an ampkit_error.
# R errors pass through untouched.
py_try <- function(expr, context = NULL) {
  withCallingHandlers(expr, error = function(e) {
    if (is_py_error(e)) stop(py_error_condition(e, context))
  })
}

# For calls not wrapped in py_try() (tensor and optimizer methods): only a
# CUDA out-of-memory error becomes an ampkit_error (after collecting R's
# garbage); other errors pass as they are.
py_oom_error <- function(e) {
  if (!is_py_error(e)) return()
  err <- tryCatch(reticulate::py_last_error(), error = function(e) NULL)
  if (!is.null(err) && !is.null(err$type) && is_oom(err$type)) stop(py_error_condition(e))
}

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
