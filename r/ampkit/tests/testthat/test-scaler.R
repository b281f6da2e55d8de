# The same seeded loop, once driven by Python and once by R, with Inf
# injected at known steps: the scale trajectory, the losses, the skip
# counters and the final weights must be identical.
scaler_loop_py <- "
import torch, ampkit
torch.manual_seed(7)
net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
scaler = ampkit.GradScaler('cpu', init_scale=256.0, growth_factor=2.0, backoff_factor=0.5,
                           growth_interval=2, hysteresis=1)
xs = [torch.randn(8, 4) for _ in range(12)]
ys = [torch.randn(8, 2) for _ in range(12)]
scales, losses = [], []
for i in range(12):
    x = xs[i].mul(float('inf')) if i in (3, 4, 8) else xs[i]
    with ampkit.autocast('cpu', dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(net(x), ys[i])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scales.append(scaler.get_scale())
    losses.append(loss.item())
weights = net.weight.detach().flatten().tolist() + net.bias.detach().tolist()
st = scaler.stats()
skipped, steps = st.skipped, st.steps
"

test_that("the scaler's trajectory from R equals the Python core's on the same seeds", {
  skip_if_no_ampkit()
  gold <- py_golden(scaler_loop_py)

  torch_manual_seed(7)
  net <- nn_linear(4, 2)
  opt <- optim_sgd(net$parameters, lr = 0.05)
  scaler <- amp_grad_scaler("cpu", init_scale = 256, growth_factor = 2, backoff_factor = 0.5,
                            growth_interval = 2, hysteresis = 1)
  xs <- lapply(1:12, function(i) torch_randn(8, 4))
  ys <- lapply(1:12, function(i) torch_randn(8, 2))
  loss_fn <- nn_mse_loss()
  scales <- losses <- numeric(12)
  for (i in 1:12) {
    x <- if (i %in% c(4, 5, 9)) xs[[i]]$mul(Inf) else xs[[i]]
    with_autocast(device_type = "cpu", dtype = "bfloat16", {
      loss <- loss_fn(net(x), ys[[i]])
    })
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    opt$zero_grad()
    scales[i] <- scaler$get_scale()
    losses[i] <- loss$item()
  }
  p <- net$parameters
  weights <- c(unlist(p[["weight"]]$detach()$flatten()$tolist()), unlist(p[["bias"]]$detach()$tolist()))

  expect_identical(scales, unlist(gold$scales))
  expect_identical(losses, unlist(gold$losses))
  expect_identical(weights, unlist(gold$weights))
  st <- scaler$stats()
  expect_equal(st$skipped, gold$skipped)
  expect_equal(st$steps, gold$steps)
  # the trajectory walks the state machine: backoff on the injected steps, growth every 2 clean ones
  expect_equal(scales[1:5], c(256, 512, 512, 256, 128))
  expect_equal(st$skipped, 3L)
})

test_that("state_dict() round-trips every field with non-default values", {
  skip_if_no_ampkit()
  a <- amp_grad_scaler("cpu", init_scale = 32, growth_factor = 4, backoff_factor = 0.25,
                       growth_interval = 3, hysteresis = 2, min_scale = 1, max_scale = 2^20)
  net <- nn_linear(3, 1)
  opt <- optim_sgd(net$parameters, lr = 0.01)
  for (i in 1:4) {
    a$scale(net(torch_randn(2, 3))$sum())$backward()
    a$step(opt)
    a$update()
    opt$zero_grad()
  }
  sd <- a$state_dict()
  b <- amp_grad_scaler("cpu")
  b$load_state_dict(sd)
  expect_identical(b$state_dict(), sd)
  expect_identical(b$get_scale(), a$get_scale())
  expect_equal(sd$growth_factor, 4)
  expect_equal(sd$backoff_factor, 0.25)
  expect_identical(sd$growth_interval, 3L)
  # counters written by hand as R doubles go back to Python as ints
  sd$growth_interval <- 5
  b$load_state_dict(sd)
  expect_identical(b$state_dict()$growth_interval, 5L)
})

test_that("a disabled scaler passes the loss through and steps the optimizer", {
  skip_if_no_ampkit()
  s <- amp_grad_scaler("cpu", enabled = FALSE)
  expect_false(s$is_enabled())
  loss <- torch_randn(1)$sum()
  expect_true(pt()$equal(s$scale(loss), loss))
  net <- nn_linear(2, 1)
  before <- net$parameters[["weight"]]$clone()
  opt <- optim_sgd(net$parameters, lr = 0.5)
  s$scale(net(torch_randn(4, 2))$sum())$backward()
  s$step(opt)
  s$update()
  expect_false(pt()$equal(before, net$parameters[["weight"]]))
})

test_that("update(new_scale) sets the scale and get_scale() returns an R number", {
  skip_if_no_ampkit()
  s <- amp_grad_scaler("cpu", init_scale = 8)
  net <- nn_linear(2, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  s$scale(net(torch_randn(3, 2))$sum())$backward()
  s$step(opt)
  s$update(new_scale = 1024)
  expect_identical(s$get_scale(), 1024)
  expect_type(s$get_scale(), "double")
})

test_that("misuse of the scaler raises R conditions with a clear message", {
  skip_if_no_ampkit()
  s <- amp_grad_scaler("cpu")
  err <- expect_error(s$scale("loss"), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "torch tensor")
  expect_error(s$scale(1.5), class = "ampkit_error")
  expect_error(s$step("opt"), class = "ampkit_bad_argument")
  net <- nn_linear(2, 1)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  s$scale(net(torch_randn(3, 2))$sum())$backward()
  s$step(opt)
  err <- expect_error(s$step(opt), class = "ampkit_python_error")
  expect_s3_class(err, "ampkit_error")
  expect_match(conditionMessage(err), "update\\(\\)")
  expect_error(amp_grad_scaler("gpu"), class = "ampkit_bad_device")
  expect_error(amp_grad_scaler("cpu", growth_interval = 2.5), class = "ampkit_bad_argument")
  expect_error(amp_grad_scaler("cpu", hysterisis = 2), class = "ampkit_bad_argument")
  expect_error(s$load_state_dict("x"), class = "ampkit_bad_argument")
})

test_that("print() shows the scale and the state", {
  skip_if_no_ampkit()
  s <- amp_grad_scaler("cpu", init_scale = 4096)
  expect_output(print(s), "<ampkit_grad_scaler>")
  expect_output(print(s), "scale: 4096")
  expect_s3_class(s, "ampkit_grad_scaler")
})

test_that("cuda_amp_grad_scaler() is amp_grad_scaler(device = 'cuda')", {
  skip_if_no_ampkit()
  if (cuda_is_available()) {
    s <- cuda_amp_grad_scaler(init_scale = 2^8)
  } else {
    expect_warning(s <- cuda_amp_grad_scaler(init_scale = 2^8), "CUDA is not available",
                   class = "ampkit_python_warning")
  }
  expect_equal(s$py$device, "cuda")
  expect_equal(s$is_enabled(), cuda_is_available())
})

test_that("cuda_amp_grad_scaler() takes amp_grad_scaler()'s arguments and defaults, but not `device`", {
  skip_if_no_ampkit()
  quiet <- function(code) withCallingHandlers(code, ampkit_python_warning = function(w) invokeRestart("muffleWarning"))
  # the defaults: one state, field by field
  expect_identical(quiet(cuda_amp_grad_scaler())$state_dict(),
                   quiet(amp_grad_scaler("cuda"))$state_dict())
  # arguments by name and by position, the extra options of `...` too
  a <- quiet(cuda_amp_grad_scaler(2^9, 3, growth_interval = 7, hysteresis = 2))
  b <- quiet(amp_grad_scaler("cuda", 2^9, 3, growth_interval = 7, hysteresis = 2))
  expect_identical(a$state_dict(), b$state_dict())
  expect_equal(a$py$get_growth_factor(), 3)
  err <- expect_error(cuda_amp_grad_scaler(device = "cpu"), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "amp_grad_scaler(device = ...)", fixed = TRUE)
  expect_error(cuda_amp_grad_scaler(growth_intervall = 5), class = "ampkit_bad_argument")
})

test_that("unscale_() divides the gradients by the scale before step(), as in Python", {
  skip_if_no_ampkit()
  torch <- pt()
  torch_manual_seed(5)
  net <- nn_linear(3, 2)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  s <- amp_grad_scaler("cpu", init_scale = 2^12)
  x <- torch_randn(4, 3)
  s$scale(net(x)$pow(2)$sum())$backward()
  scaled <- net$parameters[["weight"]]$grad$clone()
  s$unscale_(opt)
  unscaled <- net$parameters[["weight"]]$grad
  expect_true(torch$equal(unscaled, scaled$div(2^12)))
  # the control: plain backward, no scaler
  torch_manual_seed(5)
  ctrl <- nn_linear(3, 2)
  ctrl(x)$pow(2)$sum()$backward()
  expect_true(torch$equal(unscaled, ctrl$parameters[["weight"]]$grad))
  s$step(opt)
  s$update()
  expect_equal(s$stats()$steps, 1L)
})
