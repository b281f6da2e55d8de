# The numerics doctor from R: the same findings as the core, faults named, bad input.

# Python's UserWarnings off until the calling test ends (the injector's backward hook on a
# first layer, make_train_step's "no CUDA graph on cpu"); the filters are restored after.
local_quiet_python_warnings <- function(.env = parent.frame()) {
  w <- reticulate::import("warnings")
  ctx <- w$catch_warnings()
  ctx$`__enter__`()
  w$filterwarnings("ignore", category = reticulate::import_builtins()$UserWarning)
  withr::defer(ctx$`__exit__`(NULL, NULL, NULL), envir = .env)
}

overflowing_net <- function() {
  net <- nn_sequential(nn_linear(4, 4), nn_relu(), nn_linear(4, 1))
  with(pt()$no_grad(), net[2]$weight$fill_(3e4))  # fits float16; its product with 100 does not
  net
}

test_that("amp_doctor() names the op, module, phase and step as a one-row data.frame", {
  skip_if_no_ampkit()
  torch_manual_seed(0)
  net <- overflowing_net()
  doc <- amp_doctor(net)
  expect_null(doc$first_nonfinite())
  x <- pt()$full(list(2L, 4L), 100)
  with_autocast(device_type = "cpu", dtype = torch_float16(), y <- net(x))
  f <- doc$first_nonfinite()
  doc$close()
  expect_s3_class(f, "data.frame")
  expect_equal(nrow(f), 1)
  expect_equal(f$op, "addmm")
  expect_equal(f$module, "2")
  expect_equal(f$phase, "forward")
  expect_equal(f$dtype, "float16")
  expect_equal(f$step, 0)
  expect_equal(f$output_absmax, Inf)
  # the oracle: the input of layer 2 computed by hand under torch's autocast
  h <- with(pt()$autocast("cpu", dtype = torch_float16()), pt()$relu(net[0](x)))
  expect_equal(f$input_absmax, max(h$abs()$max()$item(), 3e4, net[2]$bias$abs()$max()$item()), tolerance = 1e-6)
})

test_that("$stats() is a data.frame per module and sampled step, and $suggest() pins the module", {
  skip_if_no_ampkit()
  net <- overflowing_net()
  doc <- amp_doctor(net, every = 2)
  for (i in 1:3) with_autocast(device_type = "cpu", dtype = torch_float16(), y <- net(pt()$full(list(2L, 4L), 100)))
  s <- doc$stats()
  expect_s3_class(s, "data.frame")
  expect_setequal(unique(s$step), c(0, 2))
  expect_setequal(unique(s$module), c("0", "1", "2"))
  expect_gt(s$overflow[s$module == "2" & s$step == 0], 0)
  expect_equal(s$overflow[s$module == "0"], c(0, 0))
  p <- doc$suggest()
  expect_s3_class(p, "ampkit_policy")
  expect_equal(amp_scopes(p), data.frame(scope = "2", pin = "float32", op = NA_character_, category = NA_character_))
  png <- tempfile(fileext = ".png")
  expect_equal(doc$heatmap(png), png)
  expect_equal(readBin(png, "raw", 4), as.raw(c(0x89, 0x50, 0x4e, 0x47)))
  doc$close()
  remove <- amp_apply_scopes(p, net)
  y <- with_autocast(device_type = "cpu", dtype = torch_float16(), net(pt()$full(list(2L, 4L), 100)))
  remove()
  expect_true(pt()$isfinite(y)$all()$item())
})

test_that("the doctor names the injected op, module and phase of the fault suite from R", {
  skip_if_no_ampkit()
  skip_if_no_repo()
  local_quiet_python_warnings()
  faults <- reticulate::import_from_path("faults", file.path(repo_dir(), "tests", "python"))
  bench <- reticulate::import("ampkit.bench")
  plan <- faults$plan()
  hits <- 0
  for (f in plan) {
    built <- bench$build_case(f$case, "tiny", device = "cpu")
    model <- built$new_model()
    opt <- built$new_optimizer(model)
    dtype <- if (f$dtype == "float16") torch_float16() else torch_bfloat16()
    scaler <- amp_grad_scaler("cpu", init_scale = 1)
    step <- if (f$mode == "train_step") {
      amp_train_step(model, built$loss_fn, opt, scaler = scaler, device_type = "cpu", dtype = dtype,
                     capture = FALSE)
    } else {
      function(x, y) {
        opt$zero_grad()
        loss <- with_autocast(device_type = "cpu", dtype = dtype, built$loss_fn(model(x), y))
        loss$backward()
        opt$step()
      }
    }
    inj <- faults$inject(model, f$module, f$op, f$phase, f$kind, step = 1L, occurrence = f$occurrence)
    inj$`__enter__`()
    # the eager step has no scaler: step 1's inf gradients are applied; keep_weights lets
    # the replay run the weights step 1 began with
    doc <- amp_doctor(model, keep_weights = TRUE)
    for (i in 0:1) {
      b <- built$batches[[i %% length(built$batches) + 1]]
      step(b[[1]], b[[2]])
    }
    got <- doc$first_nonfinite()
    doc$close()
    inj$`__exit__`(NULL, NULL, NULL)
    expect_equal(inj$fired_at_step, 1)
    ok <- !is.null(got) && got$op == f$op && got$module == f$module && got$phase == f$phase && got$step == 1
    expect_true(ok, info = paste(f$case, f$dtype, f$mode, f$module, f$op, f$phase, f$kind))
    hits <- hits + ok
  }
  expect_gte(length(plan), 50)
  expect_gte(hits / length(plan), 0.95)
})

test_that("bad input is an R condition that names the value, and changes nothing", {
  skip_if_no_ampkit()
  net <- nn_sequential(nn_linear(4, 4))
  for (bad in list(0, -1, 1.5, "2", NA, c(1, 2))) {
    expect_error(amp_doctor(net, every = bad), class = "ampkit_bad_argument")
    expect_error(amp_doctor(net, keep_weights = bad), class = "ampkit_bad_argument")
  }
  expect_error(amp_doctor("net"), class = "ampkit_bad_argument")
  doc <- amp_doctor(net)
  err <- expect_error(amp_doctor(net), class = "ampkit_python_error")
  expect_match(conditionMessage(err), "already armed")
  doc$close()
  amp_doctor(net)$close()  # closed: it can be armed again
  p <- amp_policy()
  err <- expect_error(amp_apply_scopes(amp_scope(p, "1", pin = "float32"), net), class = "ampkit_python_error")
  expect_match(conditionMessage(err), "matches no module")
  err <- expect_error(amp_scope(amp_scope(p, "0", pin = "float32"), "0", fp32 = "linear"),
                      class = "ampkit_python_error")
  expect_match(conditionMessage(err), "already in the policy with other rules")
  expect_error(amp_scope(p, 3, pin = "float32"), class = "ampkit_bad_argument")
})

test_that("scopes from R give torch.autocast's dtypes with the hand-written fp32 section", {
  skip_if_no_ampkit()
  net <- nn_sequential(nn_linear(4, 4), nn_linear(4, 2))
  x <- torch_randn(3, 4)
  p <- amp_scope(amp_policy(), "1", pin = "float32")
  remove <- amp_apply_scopes(p, net)
  got <- with_autocast(device_type = "cpu", net(x))
  remove()
  want <- with(pt()$autocast("cpu", dtype = torch_bfloat16()), {
    h <- net[0](x)
    with(pt()$autocast("cpu", enabled = FALSE), net[1](h$float()))
  })
  expect_equal(dtype_name(got), "float32")
  expect_true(pt()$equal(got, want))
  expect_equal(dtype_name(with_autocast(device_type = "cpu", net(x))), "bfloat16")
})

# A float16 run whose scale starts too high (its first steps back off) with an outlier batch at
# step 8, trained beside a copy stepped by torch.amp.GradScaler: the oracle's skips and scales.
verdict_run <- function() {
  torch_manual_seed(0)
  net <- nn_sequential(nn_linear(8, 8), nn_relu(), nn_linear(8, 1))
  twin <- reticulate::import("copy")$deepcopy(net)
  opt <- optim_sgd(net$parameters, lr = 1e-3)
  topt <- optim_sgd(twin$parameters, lr = 1e-3)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^40)
  ref <- pt()$amp$GradScaler("cpu", init_scale = 2^40)
  g <- pt()$Generator()$manual_seed(1L)
  xs <- lapply(1:12, function(i) pt()$randn(16L, 8L, generator = g))
  reticulate::py_set_item(xs[[9]], reticulate::tuple(1L, 2L), 1e6)  # step 8: its cast to float16 in layer 0 overflows
  y <- pt()$randn(16L, 1L)
  doc <- amp_doctor(net)
  skipped <- logical(0)
  for (x in xs) {
    opt$zero_grad()
    with_autocast(device_type = "cpu", dtype = torch_float16(), loss <- nn_mse_loss()(net(x)$float(), y))
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    topt$zero_grad()
    with(pt()$autocast("cpu", dtype = torch_float16()),
         tloss <- pt()$nn$functional$mse_loss(twin(x)$float(), y))
    ref$scale(tloss)$backward()
    before <- ref$get_scale()
    ref$step(topt)
    ref$update()
    skipped <- c(skipped, ref$get_scale() < before)  # (hysteresis 1: a skip is a backoff)
  }
  list(doc = doc, scaler = scaler, skipped = skipped)
}

test_that("$findings() tells the scaler's backoffs (handled) from the outlier batch (harmful)", {
  skip_if_no_ampkit()
  run <- verdict_run()
  doc <- run$doc
  first <- doc$first_nonfinite()
  expect_equal(first$step, 0)
  expect_equal(first$phase, "backward")
  found <- doc$findings(run$scaler)
  doc$close()
  expect_equal(found$step, which(run$skipped) - 1)  # every step the oracle skipped
  # the documented rule from the oracle: a forward finding is harmful; a skipped backward one
  # is handled within 16 consecutive skips (no min_scale)
  runs <- ave(as.integer(run$skipped), cumsum(!run$skipped), FUN = cumsum)
  want <- ifelse(found$phase == "backward" & runs[found$step + 1] <= 16, "handled", "harmful")
  expect_equal(found$verdict, want)
  harmful <- found[found$verdict == "harmful", ]
  expect_equal(harmful$step[1], 8)
  expect_equal(harmful$phase[1], "forward")
  expect_equal(harmful$module[1], "0")
})

test_that("$first_harmful() is the outlier batch, and $suggest(scaler) pins its module", {
  skip_if_no_ampkit()
  run <- verdict_run()
  f <- run$doc$first_harmful(run$scaler)
  expect_equal(c(f$op, f$module, f$phase, f$dtype, f$verdict), c("_to_copy", "0", "forward", "float16", "harmful"))
  expect_equal(f$step, 8)
  expect_equal(amp_scopes(run$doc$suggest(run$scaler))$scope, "0")
  expect_equal(nrow(amp_scopes(run$doc$suggest())), 0)  # without the scaler: the first finding is backward
  expect_match(reticulate::py_str(run$doc$py), "handled, 1 harmful")
  run$doc$close()
})

test_that("$findings() and $first_harmful() want the run's amp_grad_scaler()", {
  skip_if_no_ampkit()
  doc <- amp_doctor(nn_linear(2, 2))
  expect_error(doc$findings(pt()$amp$GradScaler("cpu")), class = "ampkit_bad_argument")
  expect_error(doc$first_harmful(NULL), class = "ampkit_bad_argument")
  expect_error(doc$suggest("scaler"), "amp_grad_scaler", class = "ampkit_bad_argument")
  doc$close()
})

test_that("$fp8_stats() gives the fp8 fractions of the definition, and $suggest() moves that module back", {
  skip_if_no_ampkit()
  torch_manual_seed(0)
  net <- nn_sequential(nn_linear(32, 32), nn_linear(32, 16))
  with(pt()$no_grad(), net[1]$weight[0][0]$fill_(1e6))  # the weight's scale 448/1e6 flushes the rest
  fp8 <- amp_policy("fp8")
  doc <- amp_doctor(net, every = 1, policy = fp8)
  with_autocast(device_type = "cpu", policy = fp8, y <- net(torch_randn(64, 32)))
  y$float()$sum()$backward()
  s <- doc$fp8_stats()
  shown <- reticulate::py_str(doc$py)
  p <- doc$suggest()
  kept <- doc$suggest(fp8_underflow = 0.999)
  doc$close()
  expect_s3_class(s, "data.frame")
  expect_equal(nrow(s), 6)
  expect_setequal(paste(s$module, s$operand), c(paste("0", c("input", "weight", "grad_output")),
                                                 paste("1", c("input", "weight", "grad_output"))))
  # the oracle: the documented definition with plain torch ops on the weight itself
  w <- net[1]$weight$detach()
  scale <- 448 / w$abs()$max()$item()
  q <- w$mul(scale)$clamp(-448, 448)$to(dtype = pt()$float8_e4m3fn)$float()
  flushed <- pt()$logical_and(w$ne(0), q$eq(0))$sum()$item() / w$numel()
  row <- s[s$module == "1" & s$operand == "weight", ]
  expect_equal(row$underflow, flushed)
  expect_gt(row$underflow, 0.9)
  expect_equal(row$amax, 1e6)
  expect_equal(row$dtype, "float8_e4m3fn")
  expect_equal(s$underflow[s$module == "0"], c(0, 0, 0))
  expect_match(shown, "fp8 casts")
  expect_equal(amp_scopes(p), data.frame(scope = "1", pin = NA_character_, op = "linear",
                                         category = "lower_precision_fp"))
  expect_equal(nrow(amp_scopes(kept)), 0)  # a threshold above what was seen: no move
})

test_that("$fp8_stats() has no rows when no op ran in fp8", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  doc <- amp_doctor(net, every = 1)
  with_autocast(device_type = "cpu", dtype = torch_bfloat16(), y <- net(torch_randn(2, 4)))
  s <- doc$fp8_stats()
  doc$close()
  expect_s3_class(s, "data.frame")
  expect_equal(nrow(s), 0)
  expect_true("underflow" %in% names(s))
})
