# The misuse catalogue: for every exported function (and the scaler's methods), bad
# values, wrong types and wrong order. Each case asserts the condition's class, that
# the message names the bad value, and that nothing changed: no autocast region left
# open, torch's random state and the scaler's and the model's state as they were.

state_now <- function(scaler = NULL, net = NULL) {
  list(
    autocast = c(cpu = is_autocast_enabled("cpu")),
    regions = ampkit:::.h$open_regions(),
    rng = pt()$get_rng_state()$sum()$item(),
    scaler = if (!is.null(scaler)) scaler$state_dict(),
    params = if (!is.null(net)) lapply(unname(net$parameters), function(p) p$detach()$clone())
  )
}

expect_same_state <- function(before, after) {
  expect_identical(after[c("autocast", "regions", "rng", "scaler")],
                   before[c("autocast", "regions", "rng", "scaler")])
  for (k in seq_along(before$params)) expect_true(pt()$equal(before$params[[k]], after$params[[k]]))
}

# One misuse: `expr` must raise `class`, with `names` (a fixed string) in the message.
misuse <- function(expr, class, names, scaler = NULL, net = NULL, env = parent.frame()) {
  expr <- substitute(expr)
  before <- state_now(scaler, net)
  err <- tryCatch({
    eval(expr, env)
    NULL
  }, error = function(e) e)
  label <- paste(deparse(expr), collapse = " ")
  expect(!is.null(err), sprintf("`%s` did not fail", label))
  if (is.null(err)) return(invisible())
  expect(inherits(err, class), sprintf("`%s`: class %s, not %s", label, paste(class(err), collapse = "/"), class))
  expect(inherits(err, "ampkit_error"), sprintf("`%s`: not an ampkit_error (%s)", label, paste(class(err), collapse = "/")))
  for (n in names) {
    expect(grepl(n, conditionMessage(err), fixed = TRUE),
           sprintf("`%s`: the message does not name %s: %s", label, n, conditionMessage(err)))
  }
  expect_same_state(before, state_now(scaler, net))
  invisible(err)
}

test_that("with_autocast() and local_autocast(): bad values, types and order", {
  skip_if_no_ampkit()
  x <- torch_randn(2, 4)
  net <- nn_linear(4, 2)
  ran <- FALSE
  misuse(with_autocast(device_type = "gpu", ran <- TRUE), "ampkit_bad_device", "\"gpu\"")
  misuse(with_autocast(device_type = 1, ran <- TRUE), "ampkit_bad_device", "1")
  misuse(with_autocast(device_type = c("cpu", "cuda"), ran <- TRUE), "ampkit_bad_device", "cpu")
  misuse(with_autocast(device_type = "cpu", dtype = "int8", ran <- TRUE), "ampkit_bad_dtype", "\"int8\"")
  misuse(with_autocast(device_type = "cpu", dtype = "float64", ran <- TRUE), "ampkit_py_ValueError", "float64")
  misuse(with_autocast(device_type = "cpu", dtype = TRUE, ran <- TRUE), "ampkit_bad_dtype", "TRUE")
  misuse(with_autocast(device_type = "cpu", enabled = "yes", ran <- TRUE), "ampkit_bad_argument", "\"yes\"")
  misuse(with_autocast(device_type = "cpu", enabled = NA, ran <- TRUE), "ampkit_bad_argument", "NA")
  misuse(with_autocast(device_type = "cpu", cache_enabled = 2, ran <- TRUE), "ampkit_bad_argument", "2")
  misuse(with_autocast(device_type = "cpu", policy = "nope", ran <- TRUE), "ampkit_py_PolicyError", "'nope'")
  misuse(with_autocast(device_type = "cpu", policy = 3, ran <- TRUE), "ampkit_bad_argument", "3")
  misuse(with_autocast(device_type = "cpu", dtyp = "float16", ran <- TRUE), "ampkit_bad_argument", "dtyp")
  misuse(with_autocast({ran <- TRUE}), "ampkit_bad_device", "device_type")
  misuse(with_autocast("cpu", "float16", TRUE, NULL, 1, ran <- TRUE), "ampkit_bad_argument", "too many")
  misuse(with_autocast("cpu", "half", ran <- TRUE), "ampkit_bad_dtype", "\"half\"")
  expect_false(ran)
  misuse(local_autocast("tpu"), "ampkit_bad_device", "\"tpu\"")
  misuse(local_autocast("cpu", "int8"), "ampkit_bad_dtype", "\"int8\"")
  misuse(local_autocast("cpu", "bfloat16", "no"), "ampkit_bad_argument", "\"no\"")
  misuse(local_autocast("cpu", "bfloat16", TRUE, NULL, "extra"), "ampkit_bad_argument", "\"extra\"")
  misuse(local_autocast(), "ampkit_bad_device", "device_type")
  misuse(is_autocast_enabled("gpu"), "ampkit_bad_device", "\"gpu\"")
  misuse(get_autocast_dtype(NULL), "ampkit_bad_device", "NULL")
  # a Python error inside the region leaves it closed
  misuse(with_autocast(device_type = "cpu", net(torch_randn(2, 5))), "ampkit_python_error", "2x5")
})

test_that("the scaler: bad construction and methods called with wrong values or in the wrong order", {
  skip_if_no_ampkit()
  misuse(amp_grad_scaler("gpu"), "ampkit_bad_device", "\"gpu\"")
  misuse(amp_grad_scaler("cpu", init_scale = -1), "ampkit_py_ValueError", "-1")
  misuse(amp_grad_scaler("cpu", init_scale = "big"), "ampkit_bad_argument", "\"big\"")
  misuse(amp_grad_scaler("cpu", growth_factor = 0.5), "ampkit_py_ValueError", "0.5")
  misuse(amp_grad_scaler("cpu", backoff_factor = 2), "ampkit_py_ValueError", "2")
  misuse(amp_grad_scaler("cpu", growth_interval = 2.5), "ampkit_bad_argument", "2.5")
  misuse(amp_grad_scaler("cpu", growth_interval = 0), "ampkit_py_ValueError", "0")
  misuse(amp_grad_scaler("cpu", enabled = "yes"), "ampkit_bad_argument", "\"yes\"")
  misuse(amp_grad_scaler("cpu", hysteresis = 0), "ampkit_py_ValueError", "0")
  misuse(amp_grad_scaler("cpu", min_scale = 10, max_scale = 1), "ampkit_py_ValueError", "10")
  misuse(amp_grad_scaler("cpu", growthfactor = 2), "ampkit_bad_argument", "growthfactor")
  misuse(cuda_amp_grad_scaler(device = "cpu"), "ampkit_bad_argument", "device")

  torch_manual_seed(1)
  net <- nn_linear(4, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^8)
  x <- torch_randn(3, 4)
  y <- torch_randn(3, 1)
  # wrong order: step and update before any scale()
  misuse(scaler$step(opt), "ampkit_python_error", "scale", scaler = scaler, net = net)
  misuse(scaler$update(), "ampkit_python_error", "scale", scaler = scaler, net = net)
  misuse(scaler$unscale_(opt), "ampkit_python_error", "scale", scaler = scaler, net = net)
  # wrong types
  misuse(scaler$scale(1.5), "ampkit_bad_argument", "1.5", scaler = scaler, net = net)
  misuse(scaler$scale("loss"), "ampkit_bad_argument", "\"loss\"", scaler = scaler, net = net)
  misuse(scaler$step("opt"), "ampkit_bad_argument", "\"opt\"", scaler = scaler, net = net)
  misuse(scaler$update(new_scale = "x"), "ampkit_bad_argument", "\"x\"", scaler = scaler, net = net)
  misuse(scaler$load_state_dict(3), "ampkit_bad_argument", "3", scaler = scaler, net = net)
  misuse(scaler$load_state_dict(list(scale = 2)), "ampkit_python_error", "growth_interval", scaler = scaler, net = net)
  misuse(scaler$load_state_dict(modifyList(scaler$state_dict(), list(scale = -2))),
         "ampkit_python_error", "-2", scaler = scaler, net = net)
  misuse(scaler$load_state_dict(modifyList(scaler$state_dict(), list(growth_interval = 2.5))),
         "ampkit_python_error", "2.5", scaler = scaler, net = net)
  # a valid iteration still runs, then step twice without update is refused
  scaler$scale(nn_mse_loss()(net(x), y))$backward()
  scaler$step(opt)
  stepped <- lapply(unname(net$parameters), function(p) p$detach()$clone())
  misuse(scaler$step(opt), "ampkit_python_error", "step", scaler = scaler, net = net)
  scaler$update()
  opt$zero_grad()
  expect_equal(scaler$get_scale(), 2^8)
})

test_that("amp_train_step(): every argument checked when the step is made", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  loss <- nn_mse_loss()
  misuse(amp_train_step(net, loss, opt, dtype = "float64"), "ampkit_py_ValueError", "float64", net = net)
  misuse(amp_train_step(net, loss, opt, dtype = "int8"), "ampkit_bad_dtype", "\"int8\"", net = net)
  misuse(amp_train_step(net, loss, opt, enabled = "yes"), "ampkit_bad_argument", "\"yes\"", net = net)
  misuse(amp_train_step(net, loss, opt, policy = "nope"), "ampkit_py_PolicyError", "'nope'", net = net)
  misuse(amp_train_step(net, loss, opt, device_type = "gpu"), "ampkit_bad_device", "\"gpu\"", net = net)
  misuse(amp_train_step(net, loss, opt, capture = "sometimes"), "ampkit_bad_argument", "\"sometimes\"", net = net)
  misuse(amp_train_step(net, loss, opt, warmup = -1), "ampkit_bad_argument", "-1", net = net)
  misuse(amp_train_step(net, loss, opt, warmup = 1.5), "ampkit_bad_argument", "1.5", net = net)
  misuse(amp_train_step(net, loss, opt, scaler = "s"), "ampkit_bad_argument", "\"s\"", net = net)
  misuse(amp_train_step("net", loss, opt), "ampkit_bad_argument", "\"net\"", net = net)
  misuse(amp_train_step(net, 3, opt), "ampkit_bad_argument", "3", net = net)
  misuse(amp_train_step(net, loss, net), "ampkit_bad_argument", "optimizer", net = net)
  misuse(amp_train_step(net, opt, loss), "ampkit_bad_argument", "optimizer", net = net)  # wrong order
  misuse(amp_train_step(net, loss, opt, "cpu"), "ampkit_bad_argument", "\"cpu\"", net = net)
})

test_that("policies and traces", {
  skip_if_no_ampkit()
  misuse(amp_policy("nope"), "ampkit_py_PolicyError", "'nope'")
  misuse(amp_policy(42), "ampkit_bad_argument", "42")
  misuse(amp_policy("torch_default", fp32 = 3), "ampkit_bad_argument", "3")
  misuse(amp_policy("torch_default", "matmul"), "ampkit_bad_argument", "category")
  misuse(amp_policy("torch_default", fp32 = "linear", device = "gpu"), "ampkit_bad_device", "\"gpu\"")
  misuse(amp_policy("torch_default", fp33 = "linear"), "ampkit_python_error", "fp33")
  # R errors in the traced code pass as they are (not ampkit's), and the trace ends
  before <- state_now()
  expect_error(amp_trace(stop("inside the trace")), "inside the trace")
  expect_same_state(before, state_now())
})

test_that("the torch layer: constructors and optimizers", {
  skip_if_no_ampkit()
  misuse(torch_manual_seed("a"), "ampkit_bad_argument", "\"a\"")
  misuse(torch_manual_seed(1.5), "ampkit_bad_argument", "1.5")
  misuse(torch_randn(2, "x"), "ampkit_bad_argument", "\"x\"")
  misuse(torch_randn(2, -3), "ampkit_bad_argument", "-3")
  misuse(torch_randn(2, device = "gpu"), "ampkit_bad_device", "\"gpu\"")
  misuse(torch_randn(2, dtype = "int"), "ampkit_bad_dtype", "\"int\"")
  misuse(torch_randn(2, requires_grad = "yes"), "ampkit_bad_argument", "\"yes\"")
  misuse(nn_linear(0, 2), "ampkit_bad_argument", "0")
  misuse(nn_linear(4, "two"), "ampkit_bad_argument", "\"two\"")
  misuse(nn_linear(4, 2, bias = "no"), "ampkit_bad_argument", "\"no\"")
  misuse(nn_relu(inplace = 1), "ampkit_bad_argument", "1")
  misuse(nn_sequential(nn_linear(2, 2), "relu"), "ampkit_bad_argument", "argument 2")
  misuse(nn_mse_loss(reduction = "avg"), "ampkit_bad_argument", "\"avg\"")
  misuse(nn_cross_entropy_loss(reduction = "avg"), "ampkit_bad_argument", "\"avg\"")
  misuse(nn_cross_entropy_loss(label_smoothing = 2), "ampkit_bad_argument", "2")
  misuse(nn_cross_entropy_loss(weight = "w"), "ampkit_bad_argument", "\"w\"")
  net <- nn_linear(2, 2)
  misuse(optim_sgd(net$parameters), "ampkit_bad_argument", "lr")
  misuse(optim_sgd(net$parameters, lr = -1), "ampkit_python_error", "-1", net = net)
  misuse(optim_sgd(net$parameters, lr = "fast"), "ampkit_bad_argument", "\"fast\"", net = net)
  misuse(optim_sgd(list(), lr = 0.1), "ampkit_bad_argument", "empty")
  misuse(optim_sgd(0.1, net$parameters), "ampkit_bad_argument", "0.1")  # wrong order
  misuse(optim_adam(net$parameters, betas = "b"), "ampkit_bad_argument", "\"b\"", net = net)
  misuse(optim_adam(net$parameters, betas = c(0.9, 1.5)), "ampkit_python_error", "1.5", net = net)
  misuse(optim_adamw(net$parameters, weight_decay = NA), "ampkit_bad_argument", "NA", net = net)
})

test_that("garbage watch, installation and configuration", {
  skip_if_no_ampkit()
  withr::local_options(ampkit.gc_threshold_mb = "big")
  misuse(amp_gc(), "ampkit_bad_argument", "\"big\"")
  withr::local_options(ampkit.gc_threshold_mb = NULL)
  misuse(install_ampkit(ampkit = file.path(tempdir(), "no-such-repo")), "ampkit_bad_argument", "no-such-repo")
  misuse(install_ampkit(ampkit = 3), "ampkit_bad_argument", "3")
  repo <- repo_dir()
  if (nzchar(repo)) {
    misuse(install_ampkit(repo, envname = ""), "ampkit_bad_argument", "\"\"")
    misuse(install_ampkit(repo, torch = "numpy"), "ampkit_bad_argument", "\"numpy\"")
    misuse(install_ampkit(repo, new_env = "yes"), "ampkit_bad_argument", "\"yes\"")
  }
})
