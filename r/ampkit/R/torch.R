# The thin torch layer: just enough of R torch's constructors, over Python
# torch, for AMP walkthroughs written for R torch to run with library(ampkit).
# Modules are reticulate callables, so `net(x)` works as is; `loss$backward()`,
# `opt$step()`, `opt$zero_grad()` are Python methods and `loss$item()`
# returns an R number. Coercions are in convert.R.

#' Torch constructors for AMP walkthroughs
#'
#' A thin layer over Python torch with the names of R torch, so that mixed
#' precision code written for R torch runs with `library(ampkit)`. Modules
#' are callable as R functions (`net(x)`), `net$parameters` is a named list of
#' tensors, `$cuda()` moves a module to the GPU, and tensors keep their Python
#' methods (`loss$backward()`, `loss$item()`, which returns an R number).
#' Optimizers keep theirs (`opt$step()`, `opt$zero_grad()`).
#'
#' GPU memory: a tensor returned to R (`output <- net(x)`) is freed when R
#' collects the object holding it. `opt$zero_grad()`, which a training loop
#' calls once a step, also reads the CUDA memory allocated in the same Python
#' call, and R's garbage is collected when it has grown past the option
#' `ampkit.gc_threshold_mb` (1024 MiB by default); see [amp_gc()]. An
#' out-of-memory error from a tensor or optimizer method (`loss$backward()`,
#' `opt$step()`) collects garbage and runs the call once more; a second one
#' raises a condition of class `ampkit_out_of_memory`.
#'
#' On a machine without CUDA, a module's `$cuda()` leaves the module on the
#' CPU with a warning of class `ampkit_cuda_unavailable`, so that a
#' walkthrough written for the GPU runs on the CPU with only its device strings
#' changed.
#'
#' @param seed A whole number.
#' @param ... For `torch_randn()`: the sizes of the dimensions. For
#'   `nn_sequential()`: modules, or a list of modules spliced with `!!!`.
#' @param dtype A dtype name (`"float32"`, `"float16"`, `"bfloat16"`) or a
#'   torch dtype; `NULL` for the default.
#' @param device `"cpu"`, `"cuda"`, `"cuda:<index>"` or `NULL`.
#' @param requires_grad Whether the tensor records gradients.
#' @param in_features,out_features Input and output sizes of a linear layer.
#' @param bias Whether a linear layer has a bias.
#' @param inplace Whether ReLU overwrites its input.
#' @param reduction `"mean"`, `"sum"` or `"none"`.
#' @param weight,ignore_index,label_smoothing As in torch's `CrossEntropyLoss`.
#' @param params The parameters to optimize: `net$parameters`.
#' @param lr Learning rate.
#' @param momentum,dampening,weight_decay,nesterov As in torch's `SGD`.
#' @param betas,eps,amsgrad As in torch's `Adam` and `AdamW`.
#' @return Python torch objects (tensors, modules, optimizers, dtypes);
#'   `cuda_is_available()` returns `TRUE` or `FALSE`, `torch_manual_seed()`
#'   returns `NULL` invisibly.
#' @name torch_layer
#' @examples
#' if (ampkit_available()) {
#'   torch_manual_seed(1)
#'   layers <- list(nn_linear(4, 8), nn_relu(), nn_linear(8, 2))
#'   net <- nn_sequential(!!!layers)
#'   x <- torch_randn(16, 4, device = "cpu")
#'   y <- torch_randn(16, 2, device = "cpu")
#'   loss_fn <- nn_mse_loss()
#'   opt <- optim_sgd(net$parameters, lr = 0.1)
#'   loss <- loss_fn(net(x), y)
#'   loss$backward()
#'   opt$step()
#'   opt$zero_grad()
#'   loss$item()
#'   names(net$parameters)
#' }
NULL

#' @rdname torch_layer
#' @export
torch_manual_seed <- function(seed) {
  seed <- as_py_int(seed)
  py_ready()
  py_torch$manual_seed(seed)
  invisible(NULL)
}

#' @rdname torch_layer
#' @export
torch_randn <- function(..., dtype = NULL, device = NULL, requires_grad = FALSE) {
  size <- as_py_size(list(...))
  dtype <- as_py_dtype(dtype)
  device <- as_py_device(device)
  py_ready()
  py_try(py_torch$randn(size, dtype = dtype, device = device,
                        requires_grad = as_py_bool(requires_grad)), "torch_randn()")
}

#' @rdname torch_layer
#' @export
torch_float16 <- function() torch_dtype("float16")

#' @rdname torch_layer
#' @export
torch_bfloat16 <- function() torch_dtype("bfloat16")

#' @rdname torch_layer
#' @export
torch_float32 <- function() torch_dtype("float32")

torch_dtype <- function(name) as_py_dtype(name)

# The reductions of torch's losses.
REDUCTIONS <- c("mean", "sum", "none")

#' @rdname torch_layer
#' @export
cuda_is_available <- function() {
  py_ready()
  .h$cuda_is_available()
}

#' @rdname torch_layer
#' @export
nn_linear <- function(in_features, out_features, bias = TRUE) {
  py_ready()
  py_torch$nn$Linear(as_py_int(in_features, min = 1), as_py_int(out_features, min = 1),
                     bias = as_py_bool(bias))
}

#' @rdname torch_layer
#' @export
nn_relu <- function(inplace = FALSE) {
  py_ready()
  py_torch$nn$ReLU(inplace = as_py_bool(inplace))
}

#' @rdname torch_layer
#' @export
nn_sequential <- function(...) {
  modules <- rlang::list2(...)
  for (i in seq_along(modules)) {
    if (!inherits(modules[[i]], "torch.nn.modules.module.Module")) {
      abort(sprintf("nn_sequential() takes torch modules; argument %d is %s.", i, describe(modules[[i]])),
            class = "ampkit_bad_argument")
    }
  }
  py_ready()
  if (is.null(names(modules))) return(do.call(py_torch$nn$Sequential, modules))
  named <- Map(function(n, m) reticulate::tuple(if (nzchar(n)) n else "", m), names(modules), modules)
  py_torch$nn$Sequential(reticulate::import("collections", convert = FALSE)$OrderedDict(unname(named)))
}

#' @rdname torch_layer
#' @export
nn_mse_loss <- function(reduction = "mean") {
  reduction <- as_choice(reduction, REDUCTIONS)
  py_ready()
  py_torch$nn$MSELoss(reduction = reduction)
}

#' @rdname torch_layer
#' @export
nn_cross_entropy_loss <- function(weight = NULL, ignore_index = -100, reduction = "mean",
                                  label_smoothing = 0) {
  reduction <- as_choice(reduction, REDUCTIONS)
  if (!is.null(weight) && !inherits(weight, "torch.Tensor")) {
    abort(sprintf("`weight` must be NULL or a tensor of class weights, not %s.", describe(weight)),
          class = "ampkit_bad_argument")
  }
  label_smoothing <- as_py_num(label_smoothing)
  if (label_smoothing < 0 || label_smoothing > 1) {
    abort(sprintf("`label_smoothing` must be in [0, 1], not %s.", describe(label_smoothing)),
          class = "ampkit_bad_argument")
  }
  ignore_index <- as_py_int(ignore_index)
  py_ready()
  py_torch$nn$CrossEntropyLoss(weight = weight, ignore_index = ignore_index,
                               reduction = reduction, label_smoothing = label_smoothing)
}

#' @rdname torch_layer
#' @export
optim_sgd <- function(params, lr, momentum = 0, dampening = 0, weight_decay = 0,
                      nesterov = FALSE) {
  if (missing(lr)) abort("optim_sgd() needs a learning rate: `lr`.", class = "ampkit_bad_argument")
  py_ready()
  py_try(py_torch$optim$SGD(as_py_params(params), lr = as_py_num(lr),
                            momentum = as_py_num(momentum), dampening = as_py_num(dampening),
                            weight_decay = as_py_num(weight_decay),
                            nesterov = as_py_bool(nesterov)), "optim_sgd()")
}

#' @rdname torch_layer
#' @export
optim_adam <- function(params, lr = 0.001, betas = c(0.9, 0.999), eps = 1e-8,
                       weight_decay = 0, amsgrad = FALSE) {
  adam_like("Adam", "optim_adam()", params, lr, betas, eps, weight_decay, amsgrad)
}

#' @rdname torch_layer
#' @export
optim_adamw <- function(params, lr = 0.001, betas = c(0.9, 0.999), eps = 1e-8,
                        weight_decay = 0.01, amsgrad = FALSE) {
  adam_like("AdamW", "optim_adamw()", params, lr, betas, eps, weight_decay, amsgrad)
}

# Adam and AdamW take the same arguments; only the class and the default
# weight_decay (in the exported signatures) differ.
adam_like <- function(class, context, params, lr, betas, eps, weight_decay, amsgrad) {
  py_ready()
  py_try(py_torch$optim[[class]](as_py_params(params), lr = as_py_num(lr), betas = as_py_nums(betas),
                                 eps = as_py_num(eps), weight_decay = as_py_num(weight_decay),
                                 amsgrad = as_py_bool(amsgrad)), context)
}

# R torch's module fields on Python modules: `net$parameters` is a named list
# of tensors, `net$cuda()` stays on the CPU (with a warning) without CUDA.
# Everything else is reticulate's `$`.
#' @export
`$.torch.nn.modules.module.Module` <- function(x, name) {
  if (is.null(.h$ready)) py_ready()
  switch(name,
    parameters = .h$named_parameters(x),
    cuda = if (.h$cuda_is_available()) NextMethod() else function(...) {
      warning(structure(class = c("ampkit_cuda_unavailable", "warning", "condition"),
        list(message = "CUDA is not available: `$cuda()` leaves the module on the CPU.",
             call = NULL)))
      x
    },
    NextMethod()
  )
}

# `loss$backward()`, `opt$zero_grad()`: reticulate's `$` looks the attribute
# up and wraps it in a new R function on every call (about three times the
# cost of the call itself). For tensors and optimizers, whether `name` is a
# method of the class is asked once per class and name; a method then costs
# one Python call. Attributes that are not methods (`x$dtype`, `x$grad`) take
# reticulate's path.
.methods <- new.env(parent = emptyenv())

#' @export
`$.torch.Tensor` <- function(x, name) {
  if (is_py_method(x, name)) method_function(x, name) else NextMethod()
}

# `x$name(...)`: one crossing (the bridge's call_method, retried after an out of
# memory). The returned function holds the carrier, not `x` (see py_arg()).
method_function <- function(x, name) bound_method(py_arg(x), name)

bound_method <- function(self, name) {
  force(self)
  force(name)  # an unforced promise would keep the caller's frame, and `x`, alive
  context <- paste0("$", name, "()")
  function(...) {
    if (.x$on) return(.External(.x$callx, context, CALLX_VALUE, .h$fn$call_method, self, name, ...))
    py_try(py_value(.h$call(.h$fn$call_method, c(list(self, name), dot_args(...)), dot_keywords(...))),
           context)
  }
}

# `opt$zero_grad()`, once a step in every training loop, also returns the CUDA
# memory allocated, for the garbage watch of memory.R.
#' @export
`$.torch.optim.optimizer.Optimizer` <- function(x, name) {
  if (name == "zero_grad") {
    if (is.null(.h$ready)) py_ready()
    # Bound in Python once per optimizer and kept in the optimizer's own R object
    # (an environment): no optimizer argument to convert each step.
    # The R function too: `opt$zero_grad` builds nothing after the first step.
    zero <- .subset2(x, ".ampkit_zero_grad")
    if (is.null(zero)) {
      zero <- zero_grad_function(py_fn(.h$bound_zero_grad(x)))
      assign(".ampkit_zero_grad", zero, envir = x)
    }
    return(zero)
  }
  if (is_py_method(x, name)) method_function(x, name) else NextMethod()
}

# The R function of `opt$zero_grad`, made in a frame of its own: made in the frame of
# `$`'s method, whose `x` is the dispatch's promise, still pointing to the caller's
# frame, it would keep that frame (and the outputs bound there when the first
# `opt$zero_grad()` ran) counted as referenced, and alive, as long as the optimizer.
zero_grad_function <- function(bound) {
  force(bound)
  function(...) {
    # (the compiled crossing makes the call and the garbage watch's check: src/scaler.c)
    if (.x$on) return(invisible(.External(.x$zero_grad, bound, ...)))
    watch_memory(py_try(.h$to_r(.h$call(bound, dot_args(...), dot_keywords(...))), "$zero_grad()"))
  }
}

# Modules reach R through reticulate's conversion (the constructors here, a model
# made in Python): each becomes an R function that calls it in one crossing
# (py_arg(), dot_args()), with the class and `py_object` of reticulate's own wrapper, so
# that `net(x)` costs what a bridge call costs.
#' @exportS3Method reticulate::py_to_r
py_to_r.torch.nn.modules.module.Module <- function(x) {
  if (isTRUE(attr(x, "ampkit_module"))) return(x)
  f <- NextMethod()
  if (!is.function(f) || is.null(attr(f, "py_object"))) return(f)
  module_function(f)
}

# Python functions of torch and ampkit (a loss function such as
# torch.nn.functional.cross_entropy, or one defined in ampkit.bench) take the same
# path when R converts them, so that `loss_fn(output, y)` neither costs reticulate's
# dispatch nor keeps `output` counted (memory.R). Other Python functions keep
# reticulate's own wrapper.
#' @exportS3Method reticulate::py_to_r
py_to_r.python.builtin.function <- function(x) {
  if (isTRUE(attr(x, "ampkit_module"))) return(x)
  f <- NextMethod()
  # (not while py_ready() converts the bridge's own functions)
  if (!is.function(f) || is.null(attr(f, "py_object")) || is.null(.h$ready)) return(f)
  if (!isTRUE(tryCatch(.h$is_torch_function(f), error = function(e) FALSE))) return(f)
  module_function(f)
}

module_function <- function(f) {
  if (is.null(.h$ready)) py_ready()
  obj <- attr(f, "py_object")
  module <- py_arg(obj)
  convert <- isTRUE(get0("convert", envir = obj, inherits = FALSE))
  g <- function(...) {
    # The compiled crossing makes the whole call (src/module.c), the release included.
    if (.x$on) return(.External(.x$module, obj, ...))
    # The outputs of earlier calls that R has dropped are freed in the same crossing.
    dead <- dropped_outputs()
    res <- if (is.null(dead)) .h$call(obj, dot_args(...), dot_keywords(...))
           else .h$call(.h$fn$call_releasing, c(list(dead, module), dot_args(...)), dot_keywords(...))
    if (inherits(res, "torch.Tensor")) return(keep_output(res))
    if (convert) reticulate::py_to_r(res) else res
  }
  attributes(g) <- c(attributes(f), list(ampkit_module = TRUE))
  g
}

is_py_method <- function(x, name) {
  key <- paste0(class(x)[[1L]], "$", name)
  known <- .methods[[key]]
  if (is.null(known)) {
    if (is.null(.h$ready)) py_ready()
    known <- .h$is_method(x, name)
    assign(key, known, envir = .methods)
  }
  known
}
