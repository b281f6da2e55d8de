# ---- a region whose block is only module calls, in one crossing
#
# The seed's region
#
#   with_autocast(device_type = "cuda", {
#     output <- net(data[[i]])
#     loss <- loss_fn(output, targets[[i]])
#   })
#
# crosses into Python four times when R runs it statement by statement: enter, net(x),
# loss_fn(output, y), exit. Such a block does nothing in R but pick its arguments, so the
# package sends the whole region as one call (r_bridge.run_block): enter, the calls in
# order (a later call getting an earlier one's result), exit. The results are then bound
# to their names in the caller's frame, as the block would have bound them.
#
# Which blocks: every statement is `name <- f(...)`, `name = f(...)` or `f(...)`, where
# `f` is a module or torch function that the package made into an R function (module_function()
# in torch.R: its call is one crossing and runs no R code of the user's) and each argument
# is a constant, a name, `name[[i]]` / `name[i]` (with a name or a constant inside), an
# earlier statement's name or such a call. The block's R code then only reads variables
# and indexes them; it calls nothing that could run Python or see an unfinished region.
# The analysis is made once per block expression. A name bound to a promise (a function
# argument not yet used) is read early only if its own expression is of the same kind;
# anything else (`x$to(...)`, `net(x) + 1`, print(), a user's R function, a module made
# outside the package) runs the block as written, statement by statement.
#
# An error in one of the calls binds the results of the calls before it, then raises the
# condition the statement would have raised; the region is left in both cases.
# options(ampkit.fuse_regions = FALSE) turns this off.

.fuse <- new.env(parent = emptyenv())
.fuse$exprs <- list()  # the blocks analysed last (most recent first) ...
.fuse$plans <- list()  # ... and their plans (FALSE: not fusable)
FUSE_CACHE <- 16L      # blocks remembered
FUSE_MAX_CALLS <- 32L  # calls in one block at most (the references made in Python)

# The value run_fused() returns when the block must run statement by statement.
NOT_FUSED <- new.env(parent = emptyenv())

# The plan of `expr` (analysed once, then looked up: a loop's block is the same object
# each time, which identical() tells at once), or FALSE.
region_plan <- function(expr) {
  exprs <- .fuse$exprs
  for (k in seq_along(exprs)) if (identical(exprs[[k]], expr)) return(.fuse$plans[[k]])
  plan <- tryCatch(make_plan(expr), error = function(e) FALSE)
  keep <- seq_len(min(length(exprs), FUSE_CACHE - 1L))
  .fuse$exprs <- c(list(expr), exprs[keep])
  .fuse$plans <- c(list(plan), .fuse$plans[keep])
  plan
}

# ops: one per call, in the order R would make them (a call's arguments before the call),
# each list(fn = name, args = list of argument specs, names = argument names or NULL);
# an argument spec is list(ref = j) (the result of op j), list(value = constant) or
# list(expr = expression evaluated in the caller's frame).
# targets: the name each op's result is bound to ("" for none); value: the op whose
# result is the block's value; reads: the names read from the caller's frame.
make_plan <- function(expr) {
  stmts <- if (is.call(expr) && identical(expr[[1L]], as.name("{"))) as.list(expr)[-1L] else list(expr)
  if (!length(stmts)) return(FALSE)
  st <- new.env(parent = emptyenv())
  st$ops <- list()
  st$bound <- character()   # names bound by the block so far ...
  st$bound_op <- integer()  # ... and the op whose result each holds
  st$reads <- character()
  st$fns <- character()
  st$ok <- TRUE
  targets <- character()
  last <- NA_integer_
  for (s in stmts) {
    target <- ""
    if (is.call(s) && (identical(s[[1L]], as.name("<-")) || identical(s[[1L]], as.name("=")))) {
      if (length(s) != 3L || !is.name(s[[2L]])) return(FALSE)
      target <- as.character(s[[2L]])
      s <- s[[3L]]
    }
    j <- plan_call(s, st)
    if (!st$ok || is.na(j)) return(FALSE)
    if (nzchar(target)) {
      st$bound <- c(st$bound, target)
      st$bound_op <- c(st$bound_op, j)
    }
    targets[[j]] <- target
    last <- j
  }
  n <- length(st$ops)
  if (n > FUSE_MAX_CALLS || any(st$fns %in% st$bound)) return(FALSE)
  t <- rep("", n)
  t[seq_along(targets)] <- targets
  t[is.na(t)] <- ""
  reads <- unique(st$reads)
  list(ops = st$ops, targets = t, value = last, reads = reads,
       read_calls = lapply(reads, function(r) call("substitute", as.name(r))))
}

# The op of call `x` (its arguments' ops first); NA when `x` is not such a call.
plan_call <- function(x, st) {
  if (!is.call(x) || !is.name(x[[1L]])) return(NA_integer_)
  fn <- as.character(x[[1L]])
  if (fn %in% c("[[", "[", "$", "@", "(", "{", "::", ":::", "function", "<-", "<<-", "=", "~")) {
    return(NA_integer_)
  }
  parts <- as.list(x)[-1L]
  args <- vector("list", length(parts))
  for (k in seq_along(parts)) {
    a <- parts[[k]]
    if (missing(a)) return(NA_integer_)  # f(x, )
    spec <- plan_arg(a, st)
    if (is.null(spec)) return(NA_integer_)
    args[k] <- list(spec)
  }
  st$fns <- c(st$fns, fn)
  nm <- names(parts)
  st$ops[[length(st$ops) + 1L]] <- list(fn = fn, args = args,
                                        names = if (!is.null(nm) && any(nzchar(nm))) nm)
  length(st$ops)
}

plan_arg <- function(a, st) {
  if (is.name(a)) {
    name <- as.character(a)
    at <- match(name, rev(st$bound))
    if (!is.na(at)) return(list(ref = rev(st$bound_op)[[at]]))
    st$reads <- c(st$reads, name)
    return(list(expr = a))
  }
  if (is_constant(a)) return(list(value = a))
  if (is_index(a)) {
    names <- all.names(a)[-1L]
    if (any(names %in% st$bound)) return(NULL)  # a result of the block used in R
    st$reads <- c(st$reads, names)
    return(list(expr = a))
  }
  j <- plan_call(a, st)
  if (is.na(j)) NULL else list(ref = j)
}

is_constant <- function(a) {
  is.null(a) || (is.atomic(a) && length(a) == 1L)
}

# `name[[i]]` or `name[i]`, `i` a name or a constant: reads a variable, calls nothing
# of the user's (for a Python list, reticulate's item lookup).
is_index <- function(a) {
  is.call(a) && length(a) == 3L && (identical(a[[1L]], as.name("[[")) || identical(a[[1L]], as.name("["))) &&
    is.name(a[[2L]]) && (is.name(a[[3L]]) || is_constant(a[[3L]]))
}

# Whether reading `name` in `env` now, before the region is entered, is what the block
# would have done: a variable, or a promise whose expression only reads (such as the
# `b[[1]]` a step function got for `x`).
# `read_call` is `substitute(name)`, made with the plan: evaluated in `env`, it gives a
# promise's expression, a variable's value, or (in the global environment) the name.
early_read_ok <- function(read_call, env) {
  e <- eval(read_call, env)
  if (!is.language(e) || identical(e, read_call[[2L]])) return(TRUE)
  is.name(e) || is_index(e) || is_constant(e)
}

# Run the block of `plan` in one crossing; NOT_FUSED when it must run as written.
run_fused <- function(plan, env, device_type, dtype, enabled, cache_enabled, policy) {
  ops <- plan$ops
  n <- length(ops)
  fns <- vector("list", n)
  for (k in seq_len(n)) {
    f <- get0(ops[[k]]$fn, envir = env, mode = "function")
    if (is.null(f) || !isTRUE(attr(f, "ampkit_module"))) return(NOT_FUSED)
    fe <- environment(f)
    if (!isTRUE(fe$convert)) return(NOT_FUSED)
    fns[k] <- list(fe$module)
  }
  for (rc in plan$read_calls) if (!early_read_ok(rc, env)) return(NOT_FUSED)
  region <- region_args(device_type, dtype, enabled, cache_enabled, policy)
  refs <- .h$block_refs
  args <- vector("list", n)
  kws <- vector("list", n)
  for (k in seq_len(n)) {
    specs <- ops[[k]]$args
    a <- vector("list", length(specs))
    for (i in seq_along(specs)) {
      s <- specs[[i]]
      a[i] <- list(if (!is.null(s$ref)) refs[[s$ref]]
                   else if (!is.null(s$expr)) py_arg(eval(s$expr, env))
                   else s$value)
    }
    nm <- ops[[k]]$names
    if (is.null(nm)) {
      args[k] <- list(a)
    } else {
      named <- nzchar(nm)
      args[k] <- list(a[!named])
      kws[k] <- list(stats::setNames(a[named], nm[named]))
    }
  }
  dead <- dropped_outputs()
  .fuse$failing <- list(plan = plan, env = env)
  res <- withCallingHandlers(
    .h$call(.h$fn$run_block, c(list(dead), region, list(fns, args, kws)), NULL),
    error = fused_error)
  .fuse$failing <- NULL
  bind_results(res, plan, env)
}

# Bind each result of `results` (the Python list) to its name, keeping tensors in the
# release's watch as a module call does, and return the block's value. The R list made
# here is the only one, and it lets go of each result as it is bound: a list element
# counts as a reference until R collects the list (memory.R), and a second binding to
# the list would make R copy it instead of clearing the element.
bind_results <- function(results, plan, env) {
  res <- .h$to_r(results)
  results <- NULL
  targets <- plan$targets
  value <- NULL
  for (k in seq_along(res)) {
    r <- res[[k]]
    res[k] <- list(NULL)
    if (inherits(r, "torch.Tensor")) keep_output(r)
    if (nzchar(targets[[k]])) assign(targets[[k]], r, envir = env)
    if (k == plan$value) value <- r
    r <- NULL
  }
  value
}

# A Python error in the fused call: the results of the calls that returned are bound, as
# the statements before the failing one would have bound them, and the condition is the
# one R's own path raises (entering: "with_autocast(): ...", a call: "in an autocast region").
fused_error <- function(e) {
  failing <- .fuse$failing
  .fuse$failing <- NULL
  if (is.null(failing) || !is_py_error(e)) return()
  stage <- tryCatch(.h$block_failure(), error = function(e) "")
  if (identical(stage, "enter")) py_rethrow(e, "with_autocast()")
  done <- tryCatch(.h$call(.h$fn$block_results, list(), NULL), error = function(e) NULL)
  if (!is.null(done)) bind_results(done, failing$plan, failing$env)
  done <- NULL
  py_rethrow(e, REGION_CONTEXT)
}
