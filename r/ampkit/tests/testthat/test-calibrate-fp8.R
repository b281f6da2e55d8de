# fp8 auto from R: the core's calibration, its policy used by with_autocast() and
# amp_train_step(), and the fp8 policy by name in amp_train_step().

make_net <- function() {
  torch_manual_seed(21)
  nn_sequential(nn_linear(16, 32), nn_relu(), nn_linear(32, 8))
}

# fp8 is twice as fast in module "0" only; run() must work though its time is not used.
fast_in_0 <- function(module, precision, run) {
  run()
  if (module == "0" && precision == "fp8") 1 else 2
}

# The seed's AMP loop written by hand over `net` under `policy`: the losses of three steps
# (the oracle amp_train_step() is compared with).
hand_losses <- function(net, policy, xs, ys) {
  opt <- optim_sgd(net$parameters, lr = 0.05)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
  loss_fn <- nn_mse_loss()
  vapply(seq_along(xs), function(i) {
    opt$zero_grad(set_to_none = TRUE)
    with_autocast(device_type = "cpu", policy = policy, {
      loss <- loss_fn(net(xs[[i]]), ys[[i]])
    })
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    loss$item()
  }, numeric(1))
}

test_that("amp_calibrate_fp8() returns the core's report as a data.frame and its policy", {
  skip_if_no_ampkit()
  net <- make_net()
  torch_manual_seed(22)
  x <- torch_randn(8, 16)
  cal <- amp_calibrate_fp8(net, x, timer = fast_in_0)
  expect_s3_class(cal, "ampkit_fp8_calibration")
  expect_s3_class(cal$policy, "ampkit_policy")
  want <- reticulate::import("ampkit")$calibrate_fp8(net, x, timer = fast_in_0)
  rows <- want$as_rows()
  expect_identical(cal$report$module, c("0", "2"))
  expect_identical(cal$report$precision, c("fp8", "bfloat16"))
  expect_identical(cal$report$error, vapply(rows, function(r) r$error, numeric(1)))
  expect_identical(cal$report$shapes, c("8x16", "8x32"))
  expect_identical(cal$report$speedup, c(2, 1))
  expect_match(cal$report$reason[[2]], "not fast enough")
  expect_identical(cal$policy$py$to_yaml(), want$policy$to_yaml())
  scopes <- amp_scopes(cal$policy)
  expect_identical(scopes$scope, "0")
  expect_identical(scopes$category, "fp8")
  expect_output(print(cal), "fp8 ms")
})

test_that("the calibrated policy runs fp8 only in the chosen module, in with_autocast() and amp_train_step()", {
  skip_if_no_ampkit()
  net <- make_net()
  torch_manual_seed(23)
  x <- torch_randn(8, 16)
  cal <- amp_calibrate_fp8(net, x, timer = fast_in_0)
  remove <- amp_apply_scopes(cal$policy, net)
  on.exit(remove())
  tr <- amp_trace(with_autocast(net(x), device_type = "cpu", policy = cal$region_policy))
  lin <- tr[tr$op == "linear", ]
  expect_identical(lin$rule, c("fp8", "lower_precision_fp"))
  expect_identical(lin$scope, c("0", ""))

  # the step against the hand loop with the same scopes and region policy, bit for bit
  xs <- lapply(1:3, function(i) torch_randn(8, 16))
  ys <- lapply(1:3, function(i) torch_randn(8, 8))
  twin <- make_net()
  remove_twin <- amp_apply_scopes(cal$policy, twin)
  on.exit(remove_twin(), add = TRUE)
  opt <- optim_sgd(net$parameters, lr = 0.05)
  step <- amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu", policy = cal$region_policy,
                         scaler = amp_grad_scaler("cpu", init_scale = 2^10), capture = FALSE)
  got <- vapply(1:3, function(i) step(xs[[i]], ys[[i]])$item(), numeric(1))
  want <- hand_losses(twin, cal$region_policy, xs, ys)
  expect_identical(got, want)
})

test_that("amp_train_step() takes the fp8 policy by name and matches the hand loop", {
  skip_if_no_ampkit()
  torch_manual_seed(24)
  xs <- lapply(1:3, function(i) torch_randn(8, 16))
  ys <- lapply(1:3, function(i) torch_randn(8, 8))
  net <- make_net()
  opt <- optim_sgd(net$parameters, lr = 0.05)
  tr <- amp_trace(step <- amp_train_step(net, nn_mse_loss(), opt, device_type = "cpu", policy = "fp8",
                                         scaler = amp_grad_scaler("cpu", init_scale = 2^10),
                                         capture = FALSE))
  got <- vapply(1:3, function(i) step(xs[[i]], ys[[i]])$item(), numeric(1))
  twin <- make_net()
  want <- hand_losses(twin, "fp8", xs, ys)
  expect_identical(got, want)
  # the step did run fp8: the same loop in plain bfloat16 gives other losses
  bf <- make_net()
  opt3 <- optim_sgd(bf$parameters, lr = 0.05)
  step3 <- amp_train_step(bf, nn_mse_loss(), opt3, device_type = "cpu",
                          scaler = amp_grad_scaler("cpu", init_scale = 2^10), capture = FALSE)
  plain <- vapply(1:3, function(i) step3(xs[[i]], ys[[i]])$item(), numeric(1))
  expect_false(identical(got, plain))
})

test_that("amp_calibrate_fp8() checks its arguments and names the fix", {
  skip_if_no_ampkit()
  net <- make_net()
  x <- torch_randn(4, 16)
  expect_error(amp_calibrate_fp8("net", x), class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, 1:3), "must be a tensor or a list of tensors", class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, max_error = 0), "`max_error` must be a finite number > 0, not 0",
               class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, min_speedup = Inf), "min_speedup", class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, repeats = 0), "`repeats` must be a whole number >= 1",
               class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, device_type = "tpu"), class = "ampkit_bad_device")
  expect_error(amp_calibrate_fp8(net, x, recipe = "rowwise"), "named list", class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, timer = 3), "function", class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(net, x, 0.1), class = "ampkit_bad_argument")
  expect_error(amp_calibrate_fp8(nn_relu(), x), "has no torch.nn.Linear", class = "ampkit_py_ValueError")
  expect_error(amp_calibrate_fp8(net, x, recipe = list(scaling = "blockwise")), "blockwise",
               class = "ampkit_python_error")
})
