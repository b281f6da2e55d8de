test_that("amp_train_step() gives the losses of the hand-written R loop, bit for bit", {
  skip_if_no_ampkit()
  make <- function() {
    torch_manual_seed(11)
    net <- nn_sequential(nn_linear(4, 8), nn_relu(), nn_linear(8, 1))
    list(net = net, opt = optim_sgd(net$parameters, lr = 0.05))
  }
  torch_manual_seed(12)
  xs <- lapply(1:4, function(i) torch_randn(16, 4))
  ys <- lapply(1:4, function(i) torch_randn(16, 1))

  a <- make()
  step <- amp_train_step(a$net, nn_mse_loss(), a$opt, device_type = "cpu", dtype = "bfloat16",
                         scaler = amp_grad_scaler("cpu", init_scale = 2^10), capture = FALSE)
  expect_s3_class(step, "ampkit_train_step")
  got <- vapply(1:4, function(i) step(xs[[i]], ys[[i]])$item(), numeric(1))

  b <- make()
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
  loss_fn <- nn_mse_loss()
  want <- numeric(4)
  for (i in 1:4) {
    b$opt$zero_grad(set_to_none = TRUE)
    with_autocast(device_type = "cpu", dtype = "bfloat16", {
      loss <- loss_fn(b$net(xs[[i]]), ys[[i]])
    })
    scaler$scale(loss)$backward()
    scaler$step(b$opt)
    scaler$update()
    want[[i]] <- loss$item()
  }
  expect_identical(got, want)
  expect_output(print(step), "ampkit_train_step")
})

test_that("amp_train_step() checks its arguments in R", {
  skip_if_no_ampkit()
  net <- nn_linear(2, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  expect_error(amp_train_step(net, nn_mse_loss(), opt, device_type = "gpu"), class = "ampkit_bad_device")
  expect_error(amp_train_step(net, nn_mse_loss(), opt, capture = "yes"), class = "ampkit_bad_argument")
  expect_error(amp_train_step(net, nn_mse_loss(), opt, "cpu"), class = "ampkit_bad_argument")
})

test_that("amp_train_step() passes the region's arguments when the device comes from the model", {
  skip_if_no_ampkit()
  torch_manual_seed(13)
  xs <- lapply(1:3, function(i) torch_randn(16, 4))
  ys <- lapply(1:3, function(i) torch_randn(16, 1))
  losses <- function(make_step) {
    torch_manual_seed(14)
    net <- nn_sequential(nn_linear(4, 8), nn_relu(), nn_linear(8, 1))
    opt <- optim_sgd(net$parameters, lr = 0.05)
    step <- make_step(net, opt)
    vapply(1:3, function(i) step(xs[[i]], ys[[i]])$item(), numeric(1))
  }
  # enabled = FALSE with no device_type: the steps run in float32, as with device_type given
  off <- losses(function(net, opt) amp_train_step(net, nn_mse_loss(), opt, enabled = FALSE,
                                                  capture = FALSE))
  off_cpu <- losses(function(net, opt) amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu",
                                                      enabled = FALSE, capture = FALSE))
  on <- losses(function(net, opt) amp_train_step(net, nn_mse_loss(), opt, capture = FALSE))
  expect_identical(off, off_cpu)
  expect_false(identical(off, on))  # (bfloat16 by default on the cpu: other losses)
  # dtype = "float16": the step's first loss is the float16 region's loss on the same model
  torch_manual_seed(5)
  x <- torch_randn(4, 2)
  y <- torch_randn(4, 1)
  first_loss <- function(dtype) {
    torch_manual_seed(6)
    net <- nn_linear(2, 1)
    amp_train_step(net, nn_mse_loss(), optim_sgd(net$parameters, lr = 0.1), dtype = dtype,
                   capture = FALSE)(x, y)$item()
  }
  torch_manual_seed(6)
  net <- nn_linear(2, 1)
  in_fp16 <- with_autocast(device_type = "cpu", dtype = "float16", nn_mse_loss()(net(x), y))$item()
  expect_identical(first_loss("float16"), in_fp16)
  expect_false(identical(first_loss("bfloat16"), in_fp16))
})

test_that("amp_train_step() warns once, as an R warning naming the fix, when it cannot capture", {
  skip_if_no_ampkit()
  torch <- reticulate::import("torch")
  warnings <- reticulate::import("warnings")
  saved <- reticulate::py_eval("__import__('warnings').filters[:]", convert = FALSE)
  on.exit(reticulate::py_set_attr(warnings, "filters", saved), add = TRUE)
  warnings$resetwarnings()  # (setup.R quiets this warning for the other tests)
  net <- nn_linear(4, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  w <- expect_warning(step <- amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu"),
                      class = "ampkit_python_warning")
  expect_match(conditionMessage(w), "not as a CUDA graph: autocast device_type is 'cpu'", fixed = TRUE)
  expect_match(conditionMessage(w), "capture=False runs eagerly without this warning", fixed = TRUE)
  expect_equal(attr(step, "py")$warmup, 3L)
  # later warnings (a capture given up at some step) come out after that step, in R
  attr(step, "py")$on_warning("given up at this step")
  w <- expect_warning(step(torch_randn(2, 4), torch_randn(2, 1)), class = "ampkit_python_warning")
  expect_equal(conditionMessage(w), "amp_train_step: given up at this step")
  expect_silent(step(torch_randn(2, 4), torch_randn(2, 1)))
  expect_silent(amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu", capture = FALSE))
})

test_that("amp_train_step() passes compile to torch.compile and names a bad value", {
  skip_if_no_ampkit()
  torch_manual_seed(15)
  xs <- lapply(1:3, function(i) torch_randn(16, 4))
  ys <- lapply(1:3, function(i) torch_randn(16, 1))
  run <- function(compile) {
    torch_manual_seed(16)
    net <- nn_sequential(nn_linear(4, 8), nn_relu(), nn_linear(8, 1))
    opt <- optim_sgd(net$parameters, lr = 0.05)
    step <- amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu", dtype = "bfloat16",
                           capture = FALSE, compile = compile)
    list(losses = vapply(1:3, function(i) step(xs[[i]], ys[[i]])$item(), numeric(1)),
         compiled = attr(step, "py")$compiled)
  }
  # dynamo's "eager" backend runs the traced graph with torch's own kernels: the losses
  # are the uncompiled step's, and no inductor compile is paid here
  plain <- run(FALSE)
  traced <- run(list(backend = "eager"))
  expect_false(plain$compiled)
  expect_true(traced$compiled)
  expect_identical(traced$losses, plain$losses)

  net <- nn_linear(2, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  expect_error(amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu", compile = "yes"),
               "`compile` must be TRUE, FALSE or a named list.*not \"yes\"", class = "ampkit_bad_argument")
  expect_error(amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu",
                              compile = list("max-autotune-no-cudagraphs")),
               "without a name for each element", class = "ampkit_bad_argument")
  expect_error(amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu",
                              compile = list(mode = "reduce-overhead")),
               "mode='reduce-overhead'.*max-autotune-no-cudagraphs", class = "ampkit_py_ValueError")
  expect_error(amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu",
                              compile = list(mood = "fast")),
               "unknown torch.compile argument.*'mood'", class = "ampkit_py_ValueError")
})
