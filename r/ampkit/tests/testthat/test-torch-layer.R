test_that("modules are R functions and net$parameters is a named list of tensors, as in R torch", {
  skip_if_no_ampkit()
  torch_manual_seed(3)
  layers <- list(nn_linear(4, 8), nn_relu(), nn_linear(8, 2))
  net <- nn_sequential(!!!layers)
  expect_true(is.function(net))
  p <- net$parameters
  expect_type(p, "list")
  expect_equal(names(p), c("0.weight", "0.bias", "2.weight", "2.bias"))
  expect_true(all(vapply(p, inherits, logical(1), "torch.Tensor")))
  # the control: the same seed and layers built in Python
  torch <- pt()
  torch$manual_seed(3L)
  ctrl <- torch$nn$Sequential(torch$nn$Linear(4L, 8L), torch$nn$ReLU(), torch$nn$Linear(8L, 2L))
  x <- torch_randn(5, 4)
  expect_true(torch$equal(net(x), ctrl(x)))
  # other fields and methods are reticulate's
  expect_true(net$training)
  expect_equal(length(reticulate::iterate(net$children())), 3)
})

test_that("nn_sequential() takes modules, spliced lists and names", {
  skip_if_no_ampkit()
  a <- nn_sequential(nn_linear(2, 3), nn_relu())
  b <- nn_sequential(first = nn_linear(2, 3), act = nn_relu())
  expect_equal(names(b$parameters), c("first.weight", "first.bias"))
  expect_equal(length(a$parameters), 2)
  expect_error(nn_sequential(nn_linear(2, 3), "relu"), class = "ampkit_bad_argument")
})

test_that("a training step runs and loss$item() is an R number", {
  skip_if_no_ampkit()
  torch_manual_seed(1)
  net <- nn_linear(4, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  x <- torch_randn(16, 4)
  y <- torch_randn(16, 1)
  loss_fn <- nn_mse_loss()
  first <- loss_fn(net(x), y)
  for (i in 1:20) {
    loss <- loss_fn(net(x), y)
    loss$backward()
    opt$step()
    opt$zero_grad()
  }
  expect_type(loss$item(), "double")
  expect_lt(loss$item(), first$item())
})

test_that("optim_adam() and optim_adamw() build torch's optimizers with R arguments", {
  skip_if_no_ampkit()
  net <- nn_linear(3, 2)
  adam <- optim_adam(net$parameters, lr = 0.01, betas = c(0.8, 0.9))
  adamw <- optim_adamw(net$parameters, weight_decay = 0.1)
  expect_s3_class(adam, "torch.optim.adam.Adam")
  expect_s3_class(adamw, "torch.optim.adamw.AdamW")
  g <- adam$param_groups[[1]]
  expect_equal(unlist(g$betas), c(0.8, 0.9))
  expect_equal(adamw$param_groups[[1]]$weight_decay, 0.1)
  # the defaults differ only in weight_decay, as in torch
  expect_equal(optim_adam(net$parameters)$param_groups[[1]]$weight_decay, 0)
  expect_equal(optim_adamw(net$parameters)$param_groups[[1]]$weight_decay, 0.01)
  expect_equal(optim_adamw(net$parameters)$param_groups[[1]]$lr, 0.001)
  expect_error(optim_adamw(net$parameters, eps = "small"), "`eps` must be a number", class = "ampkit_bad_argument")
  expect_error(optim_sgd(net$parameters), class = "ampkit_bad_argument")
  expect_error(optim_sgd(list(), lr = 0.1), class = "ampkit_bad_argument")
})

test_that("nn_cross_entropy_loss() runs in float32 inside a region (an fp32 op)", {
  skip_if_no_ampkit()
  torch <- pt()
  net <- nn_linear(6, 4)
  target <- torch$tensor(c(0L, 3L, 1L))
  loss_fn <- nn_cross_entropy_loss(label_smoothing = 0.1)
  with_autocast(device_type = "cpu", {
    logits <- net(torch_randn(3, 6))
    loss <- loss_fn(logits, target)
  })
  expect_equal(dtype_name(logits), "bfloat16")
  expect_equal(dtype_name(loss), "float32")
})

test_that("torch_randn() takes sizes, dtype and device; bad ones are R conditions", {
  skip_if_no_ampkit()
  x <- torch_randn(2, 3, dtype = "bfloat16", device = "cpu")
  expect_equal(shape(x), c(2, 3))
  expect_equal(dtype_name(x), "bfloat16")
  expect_equal(shape(torch_randn(c(4, 5))), c(4, 5))
  expect_error(torch_randn(2.5, 3), class = "ampkit_bad_argument")
  expect_error(torch_randn(2, device = "gpu"), class = "ampkit_bad_device")
  expect_error(torch_randn(2, dtype = "float8"), class = "ampkit_bad_dtype")
  expect_error(torch_manual_seed("a"), class = "ampkit_bad_argument")
  expect_type(cuda_is_available(), "logical")
})

test_that("$cuda() moves a module to the GPU, or warns and stays on the CPU without one", {
  skip_if_no_ampkit()
  net <- nn_linear(2, 2)
  if (cuda_is_available()) {
    expect_equal(net$cuda()$weight$device$type, "cuda")
  } else {
    expect_warning(moved <- net$cuda(), class = "ampkit_cuda_unavailable")
    expect_equal(moved$weight$device$type, "cpu")
  }
})

test_that("a Python exception from a wrapper is an ampkit_error naming the call", {
  skip_if_no_ampkit()
  err <- expect_error(optim_sgd(nn_linear(2, 2)$parameters, lr = -1), class = "ampkit_python_error")
  expect_match(conditionMessage(err), "^optim_sgd\\(\\): Python raised ValueError")
  expect_equal(err$py_type, "ValueError")
})

test_that("tensor and optimizer `$` gives methods (cached) and attributes as reticulate does", {
  skip_if_no_ampkit()
  x <- torch_randn(3, 2, requires_grad = TRUE)
  expect_true(is.function(x$sum))
  s <- x$sum()
  expect_s3_class(s, "torch.Tensor")
  s$backward()
  expect_true(pt()$equal(x$grad, pt()$ones_like(x)))
  expect_equal(dtype_name(x), "float32")
  expect_equal(shape(x), c(3, 2))
  expect_true(x$requires_grad)
  expect_type(s$item(), "double")
  expect_equal(x$to(dtype = pt()$float16)$dtype, pt()$float16)
  opt <- optim_sgd(list(x), lr = 0.5)
  opt$step()
  opt$zero_grad()
  expect_null(x$grad)
  expect_equal(opt$param_groups[[1]]$lr, 0.5)
  err <- expect_error(x$no_such_method(), "no_such_method")
})
