#' Cast policies: load, inspect and override
#'
#' A cast policy says, per device type, which dtype an autocast region uses
#' by default and which ops fall in each of five categories:
#' `lower_precision_fp` (inputs cast to the region's dtype), `fp32` (inputs
#' cast to `float32`), `fp32_output` (the op computes in `float32`),
#' `promote` (inputs cast to the widest floating input dtype) and `banned`
#' (calling the op in a region raises an error). Policies are values:
#' overriding one returns a new one.
#'
#' @param policy A policy name (`"torch_default"`, a file of the repository's
#'   `shared_specs/policies`), a path to a YAML file in that schema, or an
#'   `amp_policy()` object to override.
#' @param ... Overrides, by category: character vectors of op names, such as
#'   `fp32 = c("matmul", "linear")`. An op named here leaves its old category.
#'   For `banned`, a named character vector gives messages:
#'   `banned = c(softmax = "use log_softmax")`.
#' @param device The device types the overrides apply to (`"cpu"`, `"cuda"`);
#'   `NULL` for all.
#' @param x An `amp_policy()` object.
#' @param row.names,optional Ignored.
#' @return `amp_policy()`: an object of class `ampkit_policy` (the Python
#'   policy is in `$py`). `as.data.frame()`: one row per op and device with
#'   columns `op`, `device` and `category`; the lower-precision dtype of each
#'   device is in the attribute `"lower_precision_dtype"`.
#' @seealso [with_autocast()] takes a policy in `policy =`; [amp_trace()].
#' @export
#' @examples
#' if (ampkit_available()) {
#'   p <- amp_policy("torch_default")
#'   head(as.data.frame(p))
#'   q <- amp_policy(p, fp32 = "linear", device = "cpu")
#'   tab <- as.data.frame(q)
#'   tab[tab$op == "linear", ]
#'   with_autocast(device_type = "cpu", policy = q, {
#'     nn_linear(4, 2)(torch_randn(3, 4))$dtype
#'   })
#' }
amp_policy <- function(policy = "torch_default", ..., device = NULL) {
  overrides <- list(...)
  if (!inherits(policy, "ampkit_policy")) {
    if (!is.character(policy) || length(policy) != 1 || is.na(policy)) {
      abort(sprintf("`policy` must be a policy name, a path or an amp_policy() object, not %s.",
                    describe(policy)), class = "ampkit_bad_argument")
    }
    py_ready()
    policy <- new_policy(py_try(py_ampkit$load_policy(policy), "amp_policy()"))
  }
  if (!length(overrides)) return(policy)
  if (is.null(names(overrides)) || any(!nzchar(names(overrides)))) {
    abort("Overrides in `...` must be named by category, e.g. amp_policy(\"torch_default\", fp32 = \"matmul\").",
          class = "ampkit_bad_argument")
  }
  if (!is.null(device)) {
    for (d in device) as_device_type(d, "device")
    device <- as.list(device)
  }
  ops <- Map(function(ops, cat) {
    if (cat == "banned" && !is.null(names(ops))) as.list(ops) else as_py_ops(ops, cat)
  }, overrides, names(overrides))
  new_policy(py_try(do.call(policy$py$with_ops, c(list(device = device), ops)),
                    "amp_policy()"))
}

new_policy <- function(py) structure(list(py = py), class = "ampkit_policy")

#' @rdname amp_policy
#' @export
as.data.frame.ampkit_policy <- function(x, row.names = NULL, optional = FALSE, ...) {
  d <- x$py$to_dict()$devices
  rows <- list()
  for (dev in names(d)) {
    for (cat in setdiff(names(d[[dev]]), c("lower_precision_dtype", "fp8_recipe"))) {
      ops <- d[[dev]][[cat]]
      ops <- if (cat == "banned") names(ops) else unlist(ops)
      if (length(ops)) rows[[length(rows) + 1]] <- data.frame(op = ops, device = dev,
                                                              category = cat)
    }
  }
  out <- do.call(rbind, c(rows, list(make.row.names = FALSE)))
  if (is.null(out)) out <- data.frame(op = character(), device = character(), category = character())
  attr(out, "lower_precision_dtype") <- vapply(d, function(r) r$lower_precision_dtype, "")
  out
}

#' @export
print.ampkit_policy <- function(x, ...) {
  cat(reticulate::py_str(x$py), "\n", sep = "")
  invisible(x)
}

#' Trace the casts that autocast does
#'
#' Runs `code` while the core records every op that an autocast region
#' changed (or ran untouched), and returns the records as a data.frame.
#'
#' @param code Code to run, typically with an autocast region inside (or
#'   around) it. It is evaluated in the calling frame, so assignments persist.
#' @return A data.frame with one row per traced op call; its columns are the
#'   fields of the core's trace records (such as the op, its category, the
#'   dtypes in and out). The value of `code` is in the attribute `"value"`.
#' @seealso [amp_policy()], [with_autocast()]
#' @export
#' @examples
#' if (ampkit_available()) {
#'   net <- nn_linear(4, 2)
#'   tr <- amp_trace(with_autocast(device_type = "cpu", {
#'     y <- net(torch_randn(3, 4))
#'   }))
#'   tr
#' }
amp_trace <- function(code) {
  py_ready()
  tracer <- py_try(py_ampkit$trace(), "amp_trace()")
  entered <- py_try(tracer[["__enter__"]](), "amp_trace()")
  exit <- tracer[["__exit__"]]
  if (inherits(entered, "python.builtin.object")) tracer <- entered
  exited <- FALSE
  on.exit(if (!exited) exit(NULL, NULL, NULL), add = TRUE)
  value <- py_try(code, REGION_CONTEXT)
  exit(NULL, NULL, NULL)
  exited <- TRUE
  rows <- .h$trace_rows(tracer)
  cols <- unique(unlist(lapply(rows, names)))
  out <- records_to_df(rows, if (length(cols)) cols else c("op", "category"))
  attr(out, "value") <- value
  out
}
