test_that("with_autocast() runs the block in a region and assignments land in the caller's frame", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 3)
  x <- torch_randn(5, 4)
  with_autocast(device_type = "cpu", {
    inside <- is_autocast_enabled("cpu")
    y <- net(x)
  })
  expect_true(inside)
  expect_false(is_autocast_enabled("cpu"))
  expect_equal(dtype_name(y), "bfloat16")
  # the control: the same op with the inputs cast by hand, autocast off
  torch <- pt()
  ctrl <- torch$nn$functional$linear(x$to(torch$bfloat16), net$weight$to(torch$bfloat16),
                                     net$bias$to(torch$bfloat16))
  expect_true(torch$equal(y, ctrl))
})

test_that("with_autocast() returns the value of its block", {
  skip_if_no_ampkit()
  v <- with_autocast(device_type = "cpu", get_autocast_dtype("cpu"))
  expect_equal(v, "bfloat16")
})

test_that("dtype is taken as a string or as a torch dtype", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 3)
  x <- torch_randn(2, 4)
  a <- with_autocast(device_type = "cpu", dtype = "float16", net(x))
  b <- with_autocast(device_type = "cpu", dtype = pt()$float16, net(x))
  c <- with_autocast(device_type = "cpu", dtype = torch_bfloat16(), net(x))
  expect_equal(dtype_name(a), "float16")
  expect_equal(dtype_name(b), "float16")
  expect_equal(dtype_name(c), "bfloat16")
  expect_true(pt()$equal(a, b))
})

test_that("regions nest and enabled = FALSE turns autocast off inside an enabled region", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 3)
  x <- torch_randn(2, 4)
  with_autocast(device_type = "cpu", dtype = "bfloat16", {
    with_autocast(device_type = "cpu", dtype = "float16", {
      inner <- dtype_name(net(x))
      inner_dtype <- get_autocast_dtype("cpu")
    })
    outer_dtype <- get_autocast_dtype("cpu")
    with_autocast(device_type = "cpu", enabled = FALSE, {
      off <- dtype_name(net(x))
      off_flag <- is_autocast_enabled("cpu")
    })
    still_on <- is_autocast_enabled("cpu")
  })
  expect_equal(c(inner, inner_dtype, outer_dtype), c("float16", "float16", "bfloat16"))
  expect_equal(off, "float32")
  expect_false(off_flag)
  expect_true(still_on)
  expect_false(is_autocast_enabled("cpu"))
})

test_that("a disabled region changes nothing: results equal the plain call bit for bit", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 3)
  x <- torch_randn(2, 4)
  expect_true(pt()$equal(with_autocast(device_type = "cpu", enabled = FALSE, net(x)), net(x)))
})

test_that("local_autocast() lasts until the calling function returns", {
  skip_if_no_ampkit()
  f <- function() {
    local_autocast("cpu", dtype = "float16")
    c(is_autocast_enabled("cpu"), get_autocast_dtype("cpu") == "float16")
  }
  expect_equal(f(), c(TRUE, TRUE))
  expect_false(is_autocast_enabled("cpu"))
  g <- function() {
    local_autocast("cpu")
    stop("boom")
  }
  expect_error(g(), "boom")
  expect_false(is_autocast_enabled("cpu"))
})

test_that("state is restored when the block raises an R error or a Python exception", {
  skip_if_no_ampkit()
  expect_error(with_autocast(device_type = "cpu", stop("an R error")), "an R error")
  expect_false(is_autocast_enabled("cpu"))
  net <- nn_linear(4, 3)
  err <- expect_error(with_autocast(device_type = "cpu", net(torch_randn(2, 5))),
                      class = "ampkit_python_error")
  expect_s3_class(err, "ampkit_error")
  expect_match(conditionMessage(err), "RuntimeError: .*shapes cannot be multiplied")
  expect_false(grepl("Detailed traceback", conditionMessage(err)))
  expect_false(is_autocast_enabled("cpu"))
  # a nested region that fails restores the outer one, not "off"
  with_autocast(device_type = "cpu", dtype = "bfloat16", {
    try(with_autocast(device_type = "cpu", dtype = "float16", net(torch_randn(2, 5))), silent = TRUE)
    after <- c(is_autocast_enabled("cpu"), get_autocast_dtype("cpu") == "bfloat16")
  })
  expect_equal(after, c(TRUE, TRUE))
})

test_that("bad device, dtype and arguments are R conditions raised before Python is called", {
  skip_if_no_ampkit()
  err <- expect_error(with_autocast(device_type = "gpu", 1), class = "ampkit_bad_device")
  expect_match(conditionMessage(err), "\"cpu\", \"cuda\", not \"gpu\"")
  expect_error(with_autocast(device_type = c("cpu", "cuda"), 1), class = "ampkit_bad_device")
  expect_error(local_autocast("tpu"), class = "ampkit_bad_device")
  err <- expect_error(with_autocast(device_type = "cpu", dtype = "int8", 1), class = "ampkit_bad_dtype")
  expect_match(conditionMessage(err), "\"int8\"")
  expect_error(with_autocast(device_type = "cpu", dtype = 16, 1), class = "ampkit_bad_dtype")
  expect_error(with_autocast(device_type = "cpu", enabled = "yes", 1), class = "ampkit_bad_argument")
  expect_error(with_autocast({1}), class = "ampkit_bad_device")
  expect_error(with_autocast("cpu", dtyp = "float16", 1), class = "ampkit_bad_argument")
  expect_error(with_autocast("cpu", "bfloat16", TRUE, TRUE, 1, 2), class = "ampkit_bad_argument")
  expect_false(is_autocast_enabled("cpu"))
  expect_error(is_autocast_enabled("gpu"), class = "ampkit_bad_device")
})

test_that("an unnamed or misspelled option names it and the function that was called", {
  skip_if_no_ampkit()
  err <- expect_error(with_autocast("cpu", dtyp = "float16", 1), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "unknown argument `dtyp`", fixed = TRUE)
  err <- expect_error(with_autocast(device_type = "cpu", dtyp = "float16", 1), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "unknown: dtyp = \"float16\"", fixed = TRUE)
  err <- expect_error(local_autocast("cpu", "float16", TRUE, NULL, "extra"), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "local_autocast(device_type, dtype, enabled, cache_enabled)", fixed = TRUE)
  expect_no_match(conditionMessage(err), "with_autocast")
  err <- expect_error(amp_train_step(NULL, NULL, NULL, "cpu"), class = "ampkit_bad_argument")
  expect_match(conditionMessage(err), "amp_train_step(model, loss_fn, optimizer, device_type", fixed = TRUE)
  expect_no_match(conditionMessage(err), "with_autocast")
  expect_false(is_autocast_enabled("cpu"))
})

test_that("the block is not evaluated when the arguments are bad", {
  skip_if_no_ampkit()
  ran <- FALSE
  expect_error(with_autocast(device_type = "gpu", ran <- TRUE), class = "ampkit_error")
  expect_false(ran)
})

test_that("every region entered from R is left, also after errors", {
  skip_if_no_ampkit()
  open_regions <- ampkit:::.h$open_regions
  before <- open_regions()
  f <- function() {
    local_autocast("cpu")
    with_autocast(device_type = "cpu", stop("x"))
  }
  try(f(), silent = TRUE)
  with_autocast(device_type = "cpu", with_autocast(device_type = "cpu", enabled = FALSE, NULL))
  expect_equal(open_regions(), before)
})
