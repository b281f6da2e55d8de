# Every R -> Python coercion and argument check lives here (keras3's
# capture_args idea): reticulate passes R doubles as Python floats, so the
# arguments Python needs as integers are coerced here and nowhere else.
# Each check runs in R, before any Python call, and names the value and what
# is valid.

DEVICE_TYPES <- c("cpu", "cuda")
DTYPES <- c("float16", "bfloat16", "float32", "float64")

fmt <- function(x) {
  if (is.character(x)) paste0("\"", x, "\"", collapse = ", ")
  else paste(format(x), collapse = ", ")
}

describe <- function(x) {
  if (is.null(x)) "NULL"
  else if (is.atomic(x) && length(x) == 1) fmt(x)
  else paste0("an object of class <", class(x)[[1]], ">")
}

as_py_int <- function(x, arg = deparse(substitute(x)), min = -Inf) {
  if (!is.numeric(x) || length(x) != 1 || is.na(x) || !is.finite(x) || x != round(x) || x < min) {
    abort(sprintf("`%s` must be a whole number%s, not %s.", arg,
                  if (is.finite(min)) sprintf(" >= %d", as.integer(min)) else "", describe(x)),
          class = "ampkit_bad_argument")
  }
  as.integer(x)
}

as_py_num <- function(x, arg = deparse(substitute(x)), null_ok = FALSE) {
  if (null_ok && is.null(x)) return(NULL)
  if (!is.numeric(x) || length(x) != 1 || is.na(x)) {
    abort(sprintf("`%s` must be a number, not %s.", arg, describe(x)),
          class = "ampkit_bad_argument")
  }
  as.numeric(x)
}

as_py_nums <- function(x, arg = deparse(substitute(x))) {
  if (!is.numeric(x) || anyNA(x)) {
    abort(sprintf("`%s` must be numbers, not %s.", arg, describe(x)),
          class = "ampkit_bad_argument")
  }
  reticulate::tuple(as.list(as.numeric(x)))
}

as_py_bool <- function(x, arg = deparse(substitute(x)), null_ok = FALSE) {
  if (null_ok && is.null(x)) return(NULL)
  if (!is.logical(x) || length(x) != 1 || is.na(x)) {
    abort(sprintf("`%s` must be TRUE or FALSE, not %s.", arg, describe(x)),
          class = "ampkit_bad_argument")
  }
  x
}

# "cpu" or "cuda": the device *type* of an autocast region or a scaler.
as_device_type <- function(x, arg = "device_type") {
  if (!is.character(x) || length(x) != 1 || !(x %in% DEVICE_TYPES)) {
    abort(sprintf("`%s` must be one of %s, not %s.", arg, fmt(DEVICE_TYPES), describe(x)),
          class = "ampkit_bad_device")
  }
  x
}

# The checks of the hot path, in primitives (isTRUE(), identical() and %in% are closures,
# a few microseconds each on a small CPU): whether `x` is "cuda" or "cpu" as it stands, and
# whether it is TRUE as isTRUE() says.
is_device_type <- function(x) {
  is.character(x) && length(x) == 1L && !is.na(x) && (x == "cuda" || x == "cpu")
}
is_true <- function(x) is.logical(x) && length(x) == 1L && !is.na(x) && x

# A tensor's device: NULL, "cpu", "cuda", "cuda:1" or a torch device.
as_py_device <- function(x, arg = "device") {
  if (is.null(x) || inherits(x, "torch.device")) return(x)
  if (!is.character(x) || length(x) != 1 || !grepl("^(cpu|cuda)(:[0-9]+)?$", x)) {
    abort(sprintf("`%s` must be \"cpu\", \"cuda\" or \"cuda:<index>\", not %s.", arg, describe(x)),
          class = "ampkit_bad_device")
  }
  x
}

# A floating dtype: a name ("float16", "bfloat16", ...) or a torch dtype.
as_py_dtype <- function(x, arg = "dtype", null_ok = TRUE) {
  if (null_ok && is.null(x)) return(NULL)
  if (inherits(x, "torch.dtype")) return(x)
  if (!is.character(x) || length(x) != 1 || !(sub("^torch[._]", "", x) %in% DTYPES)) {
    abort(sprintf("`%s` must be a torch dtype or one of %s, not %s.", arg, fmt(DTYPES), describe(x)),
          class = "ampkit_bad_dtype")
  }
  # Cached with the other hot-path handles: a region that names its dtype every
  # step would otherwise pay a ~100 us lookup in torch each time.
  key <- paste0("dtype:", sub("^torch[._]", "", x))
  dt <- .h[[key]]
  if (is.null(dt)) {
    py_ready()
    dt <- .h[[key]] <- py_torch[[sub("^torch[._]", "", x)]]
  }
  dt
}

# Tensor sizes: R numbers -> a Python list of ints.
as_py_size <- function(dims, arg = "size") {
  dims <- unlist(lapply(dims, function(d) if (is.numeric(d)) as.list(d) else list(d)), recursive = FALSE)
  if (!length(dims)) return(list())
  lapply(dims, function(d) as_py_int(d, arg, min = 0))
}

# One of `choices` (a string).
as_choice <- function(x, choices, arg = deparse(substitute(x))) {
  if (!is.character(x) || length(x) != 1 || is.na(x) || !(x %in% choices)) {
    abort(sprintf("`%s` must be one of %s, not %s.", arg, fmt(choices), describe(x)),
          class = "ampkit_bad_argument", call = sys.call(-1))
  }
  x
}

# Parameters for an optimizer: `net$parameters` (an R list of tensors), a
# Python iterator, or an unevaluated Python method.
as_py_params <- function(params) {
  if (is.function(params) && inherits(params, "python.builtin.method")) params <- params()
  if (is.list(params) && !inherits(params, "python.builtin.object")) {
    params <- unname(params)
    if (!length(params)) {
      abort("`params` is empty: the optimizer has nothing to update.",
            class = "ampkit_bad_argument")
    }
    ok <- vapply(params, function(p) inherits(p, "torch.Tensor") || is.list(p), logical(1))
    if (!all(ok)) {
      abort(sprintf("`params` must be tensors (net$parameters); element %d is %s.",
                    which(!ok)[[1]], describe(params[[which(!ok)[[1]]]])), class = "ampkit_bad_argument")
    }
  } else if (!inherits(params, "python.builtin.object")) {
    abort(sprintf("`params` must be the parameters to optimize (net$parameters), not %s. The order is optim_sgd(params, lr, ...).",
                  describe(params)), class = "ampkit_bad_argument")
  }
  params
}

# A cast policy: NULL, a name or path, an amp_policy() object or a Python
# Policy. Names and paths go to Python as they are: the bridge loads them (and
# keeps shipped ones), so R repeats none of the core's rules about them.
as_py_policy <- function(x, arg = "policy") {
  if (is.null(x)) return(NULL)
  if (inherits(x, "ampkit_policy")) return(x$py)
  if (is.character(x) && length(x) == 1 && !is.na(x) && nzchar(x)) return(x)
  if (inherits(x, "python.builtin.object") && any(grepl("(^|[.])Policy$", class(x)))) return(x)
  abort(sprintf("`%s` must be a policy name, a path to a policy YAML file or an amp_policy() object, not %s.",
                arg, describe(x)), class = "ampkit_bad_argument")
}

# The Python Policy for `x` (as_py_policy()), loaded now: for constructors that
# check their arguments before they return.
load_py_policy <- function(x, context) {
  x <- as_py_policy(x)
  if (is.character(x)) {
    if (is.null(.h$ready)) py_ready()
    x <- py_try(.h$policy(x), context)
  }
  x
}

# `compile` of amp_train_step(): TRUE, FALSE or a named list of torch.compile
# arguments (a Python dict). The names and values are the core's to check: it
# knows torch.compile's arguments and which modes it refuses.
as_py_compile <- function(x, arg = "compile") {
  if (isTRUE(x) || isFALSE(x)) return(x)
  if (is.list(x) && !inherits(x, "python.builtin.object") &&
      (!length(x) || (!is.null(names(x)) && all(nzchar(names(x))) && !anyDuplicated(names(x))))) {
    return(do.call(reticulate::dict, x))
  }
  what <- if (is.list(x) && length(x)) "a list without a name for each element" else describe(x)
  abort(sprintf("`%s` must be TRUE, FALSE or a named list of torch.compile arguments, such as list(mode = \"max-autotune-no-cudagraphs\"), not %s.",
                arg, what), class = "ampkit_bad_argument")
}

# A character vector of op names per category, for Policy.with_ops().
as_py_ops <- function(ops, arg) {
  if (!is.character(ops) || anyNA(ops)) {
    abort(sprintf("`%s` must be a character vector of op names, not %s.", arg, describe(ops)),
          class = "ampkit_bad_argument")
  }
  as.list(ops)
}

# Python -> R: a list of records (dicts or dataclasses) as a data.frame.
records_to_df <- function(records, columns) {
  if (!length(records)) {
    return(as.data.frame(setNames(replicate(length(columns), character(), simplify = FALSE), columns),
                         stringsAsFactors = FALSE))
  }
  cols <- lapply(columns, function(col) {
    vals <- lapply(records, function(r) { v <- r[[col]]; if (is.null(v)) NA else v })
    if (all(vapply(vals, function(v) is.atomic(v) && length(v) == 1, logical(1)))) unlist(vals)
    else I(vals)
  })
  as.data.frame(setNames(cols, columns), stringsAsFactors = FALSE)
}

is_tensor_list <- function(x) {
  is.list(x) && length(x) > 0 &&
    all(vapply(x, function(t) inherits(t, "torch.Tensor"), logical(1)))
}

check_class <- function(x, class, arg, what) {
  if (!inherits(x, class)) {
    abort(sprintf("`%s` must be %s, not %s.", arg, what, describe(x)),
          class = "ampkit_bad_argument", call = sys.call(-2))
  }
  invisible(x)
}
