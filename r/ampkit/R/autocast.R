#' Run code in an autocast region
#'
#' Inside an autocast region, the ops that the cast policy lists run in lower
#' precision (`float16` on CUDA, `bfloat16` on the CPU by default) and the
#' others in `float32`, as the policy says. `with_autocast()` runs `code` in a
#' region and leaves it afterwards; `local_autocast()` enters a region that
#' lasts until the calling function returns (the withr convention).
#'
#' The previous autocast state is restored when the region ends, also when
#' `code` raises an error; a Python exception raised in the region becomes an
#' R condition of class `ampkit_error`. Regions nest; `enabled = FALSE` runs a
#' region with autocast off (inside an enabled one, too).
#'
#' The arguments follow mlverse torch: `with_autocast(code, ..., device_type,
#' dtype, enabled, cache_enabled)` and `local_autocast(device_type, dtype,
#' enabled, cache_enabled, ...)`, so `local_autocast("cpu", torch_bfloat16())`
#' takes the dtype second. `with_autocast()` also takes `local_autocast()`'s
#' order with the code last: `with_autocast("cpu", torch_bfloat16(), {...})`.
#'
#' @param code Code to run in the region. It is evaluated in the calling
#'   frame, so assignments made in it persist after the call. If it evaluates
#'   to a function (`code = function() net(x)`), the function is called with no
#'   arguments in the region and `with_autocast()` returns its value.
#' @param ... For `with_autocast()`: empty, or in the positional form the
#'   dtype, `enabled`, `cache_enabled` and then the code. For
#'   `local_autocast()`: must be empty.
#' @param device_type `"cuda"` or `"cpu"`.
#' @param dtype The lower-precision dtype of the region: `"float16"`,
#'   `"bfloat16"` or a torch dtype (such as `torch_float16()` of R torch's
#'   naming, or `torch$float16` from reticulate). `NULL` takes the dtype of
#'   an enclosing autocast region for the device when one is on (as torch does),
#'   else the policy's default for the device.
#' @param enabled `TRUE` or `FALSE`: whether autocast is on in the region.
#' @param cache_enabled Whether casts of parameters are cached in the region
#'   (`NULL`: the core's default).
#' @param policy A cast policy: a name (`"torch_default"`), a path to a policy
#'   YAML file, or an [amp_policy()] object. `NULL`: the default policy.
#' @param .env The frame whose exit ends the region started by
#'   `local_autocast()`.
#' @return `with_autocast()` returns the value of `code`. `local_autocast()`
#'   returns `NULL`, invisibly.
#' @seealso [amp_grad_scaler()], [amp_policy()], [amp_trace()]
#' @export
#' @examples
#' if (ampkit_available()) {
#'   x <- torch_randn(8, 4)
#'   net <- nn_linear(4, 2)
#'   with_autocast(device_type = "cpu", {
#'     y <- net(x)
#'   })
#'   y$dtype # torch.bfloat16: `y` was assigned in this frame
#'
#'   with_autocast("cpu", torch_bfloat16(), {
#'     z <- net(x)
#'   })
#'
#'   f <- function() {
#'     local_autocast("cpu", torch_bfloat16())
#'     net(x)$dtype
#'   }
#'   f()
#'   is_autocast_enabled("cpu") # FALSE again
#' }
with_autocast <- function(code, ..., device_type, dtype = NULL, enabled = TRUE,
                          cache_enabled = NULL, policy = NULL) {
  # The common call, all in compiled code (src/region.c): the options checked, then
  # `code` forced in the region (its own byte code, in the caller's frame).
  if (.x$on && !missing(device_type) && !missing(code) && !...length()) {
    return(.External(.x$region_code, environment(), device_type, dtype, enabled, cache_enabled, policy))
  }
  env <- parent.frame()
  expr <- substitute(code)
  if (missing(device_type)) {
    if (!...length() || !(is.character(expr) || is.symbol(expr))) {
      abort("`device_type` is missing: give \"cuda\" or \"cpu\", e.g. with_autocast(device_type = \"cuda\", {...}) or with_autocast(\"cuda\", torch_float16(), {...}).",
            class = "ampkit_bad_device")
    }
    # local_autocast()'s order with the code last: with_autocast("cpu", torch_bfloat16(), {...})
    return(with_autocast_positional(code, ..., env = env))
  }
  if (...length()) {
    check_dots_empty_(..., .hint = "Did you write with_autocast(\"cuda\", code) instead of with_autocast(device_type = \"cuda\", code) or with_autocast(\"cuda\", dtype, code)?")
  }
  run_region(expr, env, device_type, dtype, enabled, cache_enabled, policy)
}

# with_autocast(device_type, [dtype, [enabled, [cache_enabled,]]] code): the
# last unnamed argument is the code; the others take local_autocast()'s order.
with_autocast_positional <- function(device_type, ..., env) {
  dots <- as.list(substitute(list(...)))[-1]
  nms <- names(dots) %||% rep("", length(dots))
  unnamed <- which(!nzchar(nms))
  if (!length(unnamed)) {
    abort("with_autocast() has no code to run: give it as the last argument, e.g. with_autocast(\"cpu\", torch_bfloat16(), {...}).",
          class = "ampkit_bad_argument", call = sys.call(-1))
  }
  code_at <- unnamed[[length(unnamed)]]
  slots <- c("dtype", "enabled", "cache_enabled")
  args <- list(dtype = NULL, enabled = TRUE, cache_enabled = NULL, policy = NULL)
  pos <- setdiff(unnamed, code_at)
  if (length(pos) > length(slots)) {
    abort(sprintf("with_autocast(): too many unnamed arguments (%d); the order is device_type, dtype, enabled, cache_enabled, then the code.",
                  length(unnamed) + 1L), class = "ampkit_bad_argument", call = sys.call(-1))
  }
  for (k in seq_along(pos)) args[[slots[[k]]]] <- eval(dots[[pos[[k]]]], env)
  for (k in which(nzchar(nms))) {
    if (!nms[[k]] %in% names(args)) {
      abort(sprintf("with_autocast(): unknown argument `%s`; valid: %s.", nms[[k]],
                    paste(c("device_type", names(args)), collapse = ", ")),
            class = "ampkit_bad_argument", call = sys.call(-1))
    }
    args[nms[[k]]] <- list(eval(dots[[k]], env))
  }
  run_region(dots[[code_at]], env, device_type, args$dtype, args$enabled, args$cache_enabled, args$policy)
}

# Enter, evaluate `expr` in `env`, leave (also after an error).
#
# The block's value (often a tensor: `loss <- loss_fn(...)`) passes through no frame
# that outlives the call: the error handler is a package function (an inline one
# would keep this frame, and `value` with it, alive), and `value` is cleared on exit,
# so that R's reference count of the value drops when the caller drops it (memory.R).
run_region <- function(expr, env, device_type, dtype, enabled, cache_enabled, policy) {
  if (.x$on) {  # the same checks, then all of it in compiled code (src/region.c)
    if (!is_device_type(device_type)) device_type <- as_device_type(device_type)
    if (!is.null(dtype)) dtype <- as_py_dtype(dtype)
    if (!is_true(enabled)) enabled <- as_py_bool(enabled, "enabled")
    if (!is.null(cache_enabled)) cache_enabled <- as_py_bool(cache_enabled, "cache_enabled")
    if (!is.null(policy)) policy <- as_py_policy(policy)
    return(.External(.x$region, expr, env, device_type, dtype, enabled, cache_enabled, policy))
  }
  region <- enter_autocast(device_type, dtype, enabled, cache_enabled, policy)
  on.exit(exit_autocast(region), add = TRUE)
  value <- withCallingHandlers(eval(expr, env), error = region_error)
  if (is.function(value)) value <- withCallingHandlers(value(), error = region_error)
  on.exit(value <- NULL, add = TRUE)
  value
}

region_error <- function(e) py_rethrow(e, REGION_CONTEXT)

# run_region()'s checks and conversions of the options, for the compiled region's
# (src/region.c) options that are not passed on as they are (a list of the five): a
# pairlist of them.
region_options <- function(options) {
  device_type <- options[[1]]
  dtype <- options[[2]]
  enabled <- options[[3]]
  cache_enabled <- options[[4]]
  policy <- options[[5]]
  if (!is_device_type(device_type)) device_type <- as_device_type(device_type)
  if (!is.null(dtype)) dtype <- as_py_dtype(dtype)
  if (!is_true(enabled)) enabled <- as_py_bool(enabled, "enabled")
  if (!is.null(cache_enabled)) cache_enabled <- as_py_bool(cache_enabled, "cache_enabled")
  if (!is.null(policy)) policy <- as_py_policy(policy)
  as.pairlist(list(device_type, dtype, enabled, cache_enabled, policy))
}

# The compiled region's `eval(expr, env)` (src/region.c): `expr` is with_autocast()'s
# promise `code`, forced here.
force_code <- function(expr, env) expr

#' @rdname with_autocast
#' @export
local_autocast <- function(device_type, dtype = NULL, enabled = TRUE, cache_enabled = NULL, ...,
                           policy = NULL, .env = parent.frame()) {
  if (...length()) {
    check_dots_empty_(..., .hint = "The order is local_autocast(device_type, dtype, enabled, cache_enabled); name `policy` and `.env`.")
  }
  region <- enter_autocast(device_type, dtype, enabled, cache_enabled, policy)
  withr::defer(exit_autocast(region), envir = .env)
  invisible(NULL)
}

#' Is autocast on, and with which dtype?
#'
#' @param device_type `"cuda"` or `"cpu"`.
#' @return `is_autocast_enabled()`: `TRUE` or `FALSE`.
#'   `get_autocast_dtype()`: the dtype name, such as `"bfloat16"`.
#' @export
#' @examples
#' if (ampkit_available()) {
#'   is_autocast_enabled("cpu")
#'   with_autocast(device_type = "cpu", is_autocast_enabled("cpu"))
#'   get_autocast_dtype("cpu")
#' }
is_autocast_enabled <- function(device_type) {
  device_type <- as_device_type(device_type)
  py_ready()
  py_try(py_ampkit$is_autocast_enabled(device_type), "is_autocast_enabled()")
}

#' @rdname is_autocast_enabled
#' @export
get_autocast_dtype <- function(device_type) {
  device_type <- as_device_type(device_type)
  py_ready()
  dtype <- py_try(py_ampkit$get_autocast_dtype(device_type), "get_autocast_dtype()")
  sub("^torch\\.", "", reticulate::py_str(dtype))
}

# Checks in R first, then one Python call that builds and enters the region.
enter_autocast <- function(device_type, dtype, enabled, cache_enabled, policy) {
  if (missing(device_type)) {
    abort("`device_type` is missing: give \"cuda\" or \"cpu\", e.g. local_autocast(\"cuda\").",
          class = "ampkit_bad_device", call = sys.call(-1))
  }
  if (!is_device_type(device_type)) device_type <- as_device_type(device_type)
  if (is.null(.h$ready)) py_ready()
  if (!is.null(dtype)) dtype <- as_py_dtype(dtype)
  if (!isTRUE(enabled)) enabled <- as_py_bool(enabled, "enabled")
  if (!is.null(cache_enabled)) cache_enabled <- as_py_bool(cache_enabled, "cache_enabled")
  if (!is.null(policy)) policy <- as_py_policy(policy)
  # The token: an R integer through the compiled crossing; through reticulate a Python
  # int, which goes back to exit_autocast() unconverted.
  if (.x$on) {
    return(.External(.x$callx, "with_autocast()", CALLX_TO_R, .h$fn$enter_autocast,
                     device_type, dtype, enabled, cache_enabled, policy))
  }
  py_try(.h$call(.h$fn$enter_autocast,
                 list(device_type, py_arg(dtype), enabled, cache_enabled, py_arg(policy)), NULL),
         "with_autocast()")
}

exit_autocast <- function(region) {
  if (.x$on) .External(.x$callx, NULL, CALLX_NOTHING, .h$fn$exit_autocast, region)
  else .h$call(.h$fn$exit_autocast, list(py_arg(region)), NULL)
  invisible(NULL)
}

# The context of a Python exception raised by the code of a region (or of amp_trace()).
REGION_CONTEXT <- "in an autocast region"

# `...` of a function whose options come after it: anything there is an
# unnamed or misspelled option. `.hint` says how the caller is called right.
check_dots_empty_ <- function(..., .hint) {
  args <- as.list(substitute(list(...)))[-1]
  shown <- vapply(args, function(x) paste(deparse(x), collapse = ""), "")
  nms <- names(args)
  if (!is.null(nms)) shown[nzchar(nms)] <- paste(nms[nzchar(nms)], "=", shown[nzchar(nms)])
  abort(sprintf("Arguments after `...` must be named; unnamed or unknown: %s. %s",
                paste(shown, collapse = ", "), .hint),
        class = "ampkit_bad_argument", call = sys.call(-1))
}
