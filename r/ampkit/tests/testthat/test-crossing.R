# The compiled crossing (src/, R/crossing.R) against reticulate's, in the same session:
# the same values, classes and conditions on the hot path, with reticulate's path
# (ampkit:::use_crossing(FALSE)) as the control. The rest of the suite runs through
# whichever is in use (AMPKIT_R_COMPILED=0 runs it all through reticulate).

skip_if_no_crossing <- function() {
  skip_if_no_ampkit()
  status <- ampkit:::crossing_status()
  skip_if_not(status$on, paste("the compiled crossing is not in use:", status$why))
}

# `f()` through each crossing; the compiled one is in use again afterwards.
both <- function(f) {
  withr::defer(ampkit:::use_crossing(TRUE))
  ampkit:::use_crossing(TRUE)
  compiled <- f()
  ampkit:::use_crossing(FALSE)
  list(compiled = compiled, reticulate = f())
}

# What an R object from Python looks like to R code, without its address.
form <- function(x) {
  if (!inherits(x, "python.builtin.object")) return(list(value = x, class = class(x)))
  # (.ampkit_arg: the carrier the package keeps in an object it passed through reticulate)
  list(class = class(x), names = setdiff(sort(ls(x, all.names = TRUE)), ".ampkit_arg"),
       convert = get("convert", envir = x), str = reticulate::py_str(x))
}

condition_of <- function(expr) {
  e <- tryCatch(expr, error = function(e) e)
  list(class = class(e), message = conditionMessage(e), call = conditionCall(e),
       py_type = e$py_type, last = reticulate::py_last_error()$type)
}

test_that("module, loss and method calls give the same objects through either crossing", {
  skip_if_no_crossing()
  torch_manual_seed(4)
  net <- nn_sequential(nn_linear(4, 3), nn_relu(), nn_linear(3, 2))
  x <- torch_randn(5, 4)
  y <- torch_randn(5, 2)
  loss_fn <- nn_mse_loss()
  py_fns <- reticulate::py_run_string(paste(
    "import torch",
    "def pair(a, b=1):\n    return (a, b)",
    "def count(t):\n    return t.numel()",
    sep = "\n"))
  mod <- reticulate::py_eval("__import__('torch').nn.Identity()")
  got <- both(function() {
    out <- net(x)
    loss <- loss_fn(out, y)
    list(out = form(out), loss = form(loss), sum = out$sum()$item(),
         item = loss$item(), dtype = out$dtype$is_floating_point,
         ident = form(mod(x)), shape = form(out$shape), numel = out$numel(),
         region = form(with_autocast(device_type = "cpu", net(x))))
  })
  expect_identical(got$compiled, got$reticulate)
  expect_identical(got$compiled$out$class, c("torch.Tensor", "torch._C.TensorBase", "python.builtin.object"))
})

test_that("the scaler's and the optimizer's per-step calls give the same values and state", {
  skip_if_no_crossing()
  run <- function() {
    torch_manual_seed(5)
    net <- nn_linear(4, 2)
    opt <- optim_sgd(net$parameters, lr = 0.1)
    scaler <- amp_grad_scaler("cpu", init_scale = 2^6, growth_interval = 2)
    xs <- lapply(1:4, function(i) torch_randn(3, 4))
    y <- torch_randn(3, 2)
    out <- list()
    for (i in 1:4) {
      with_autocast(device_type = "cpu", loss <- nn_mse_loss()(net(xs[[i]]), y))
      out[[i]] <- list(backward = scaler$scale(loss)$backward(), step = scaler$step(opt),
                       update = scaler$update(), zero = opt$zero_grad(), scale = scaler$get_scale(),
                       loss = loss$item())
    }
    c(out, list(state = scaler$state_dict(), weight = net$weight$sum()$item()))
  }
  got <- both(run)
  expect_identical(got$compiled, got$reticulate)
})

test_that("Python exceptions become the same R conditions through either crossing", {
  skip_if_no_crossing()
  net <- nn_linear(4, 2)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu")
  bad <- reticulate::py_eval("lambda *a: 1 / 0")
  got <- both(function() list(
    module = condition_of(net(torch_randn(3, 5))),                       # reticulate's error as it is
    region = condition_of(with_autocast(device_type = "cpu", net(torch_randn(3, 5)))),
    region_fn = condition_of(with_autocast(device_type = "cpu", bad(1))),
    step = condition_of(scaler$step(opt)),                               # no scale() before
    method = condition_of(torch_randn(2)$view(7L)),
    r_error = condition_of(with_autocast(device_type = "cpu", stop("in R"))),
    autocast = is_autocast_enabled("cpu"),
    regions = reticulate::import("ampkit.r_bridge")$open_regions()))
  expect_identical(got$compiled, got$reticulate)
  expect_true("ampkit_python_error" %in% got$compiled$step$class)
  expect_identical(got$compiled$module$class, c("Rcpp::exception", "C++Error", "error", "condition"))
})

test_that("the step's lines return the same values, visibly or not, and fail the same way through either crossing", {
  skip_if_no_crossing()
  run <- function() {
    torch_manual_seed(6)
    net <- nn_linear(4, 2)
    opt <- optim_sgd(net$parameters, lr = 0.1)
    scaler <- amp_grad_scaler("cpu", init_scale = 2^4)
    x <- torch_randn(3, 4)
    y <- torch_randn(3, 2)
    seen <- function(v) list(value = v$value, visible = v$visible)
    region <- withVisible(with_autocast(device_type = "cpu", {
      loss <- nn_mse_loss()(net(x), y)
      loss
    }))
    scaled <- scaler$scale(loss)
    kept <- withVisible(scaled$backward(retain_graph = TRUE))  # with arguments: the loss stays
    again <- withVisible(scaled$backward())
    used <- condition_of(scaled$backward())                    # used already
    backward_fn <- scaler$scale(loss)$backward
    list(region = list(visible = region$visible, same = identical(region$value$item(), loss$item()),
                       class = class(region$value)),
         scaled_class = class(scaled), kept = seen(kept), again = seen(again),
         used = used, backward_fn = class(backward_fn),
         bad_scale = condition_of(scaler$scale(1)),
         step = seen(withVisible(scaler$step(opt))),
         bad_step = condition_of(scaler$step(net)),
         update = seen(withVisible(scaler$update())),
         zero = seen(withVisible(opt$zero_grad())),
         bad_region = condition_of(with_autocast(device_type = "gpu", 1)),
         bad_dtype = condition_of(with_autocast(device_type = "cpu", dtype = as.name("float16"), 1)),
         region_dtype = with_autocast(device_type = "cpu", dtype = "bfloat16", net(x))$dtype$is_floating_point,
         region_fn = with_autocast(device_type = "cpu", function() 7),
         weight = net$weight$sum()$item(), scale = scaler$get_scale())
  }
  got <- both(run)
  expect_identical(got$compiled, got$reticulate)
  expect_false(got$compiled$kept$visible)
  expect_true("ampkit_bad_argument" %in% got$compiled$used$class)
  expect_identical(got$compiled$region_fn, 7)
})

test_that("arguments the compiled crossing does not convert go through reticulate, with the same result", {
  skip_if_no_crossing()
  f <- reticulate::py_eval("lambda *a, **k: repr((a, sorted(k.items())))")
  module <- ampkit:::module_function(f)
  got <- both(function() list(
    module(c(1, 2), list(a = 1), NA, I(3), k = c(TRUE, FALSE)),
    module(1L, 2.5, "x", TRUE, NULL, k = 2L)))
  expect_identical(got$compiled, got$reticulate)
})

test_that("dropped outputs are let go through the compiled crossing, kept ones stay intact", {
  skip_if_no_crossing()
  net <- nn_linear(8, 8)
  x <- torch_randn(4, 8)
  ampkit:::use_crossing(TRUE)
  before <- ampkit:::crossing_status()$let_go
  kept <- list()
  for (i in 1:6) {
    out <- net(x)
    if (i == 2) kept$out <- out
  }
  invisible(net(x))
  expect_gte(ampkit:::crossing_status()$let_go - before, 4)
  expect_identical(shape(kept$out), c(4L, 8L))  # kept: not freed
  expect_true(kept$out$equal(net(x)))
})

test_that("the crossing can be turned off before Python starts, and says nothing then", {
  skip_if_no_ampkit()
  script <- paste(
    "suppressWarnings(library(ampkit))",
    "invisible(ampkit_available())",
    "s <- ampkit:::crossing_status()",
    "cat('on:', s$on, '\n')",
    "net <- nn_linear(2, 2); cat('dtype:', format(with_autocast(device_type = 'cpu', net(torch_randn(1, 2)))$dtype), '\n')",
    sep = "; ")
  run <- function(env) {
    suppressWarnings(system2(file.path(R.home("bin"), "Rscript"), c("-e", shQuote(script)),
                             env = c(paste0("R_LIBS=", paste(.libPaths(), collapse = .Platform$path.sep)), env),
                             stdout = TRUE, stderr = TRUE))
  }
  off <- run("AMPKIT_R_COMPILED=0")
  expect_true(any(grepl("on: FALSE", off, fixed = TRUE)), info = paste(off, collapse = "\n"))
  expect_true(any(grepl("dtype: torch.bfloat16", off, fixed = TRUE)), info = paste(off, collapse = "\n"))
  expect_false(any(grepl("compiled crossing", off, fixed = TRUE)))
})
