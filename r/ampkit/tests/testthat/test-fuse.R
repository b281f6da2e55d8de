# A with_autocast() block of module calls runs in one crossing (R/fuse.R): the same
# results as the block run statement by statement (options(ampkit.fuse_regions = FALSE),
# the control) and as torch.autocast in Python; blocks that do anything else run as
# written; errors bind what the statements before them bound and raise the same condition.

# Count the package's crossings into Python while `code` runs.
count_crossings <- function(code) {
  h <- ampkit:::.h
  raw <- h$call_raw
  on.exit(h$call_raw <- raw, add = TRUE)
  n <- 0L
  h$call_raw <- function(f, args, kwargs) {
    n <<- n + 1L
    raw(f, args, kwargs)
  }
  force(code)
  n
}

fuse_fixture <- function() {
  torch_manual_seed(5)
  list(xs = lapply(1:2, function(i) torch_randn(8, 16)), ys = lapply(1:2, function(i) torch_randn(8, 4)),
       net = nn_sequential(nn_linear(16, 32), nn_relu(), nn_linear(32, 4)), loss_fn = nn_mse_loss())
}

# The seed's block, in a function as a loop writes it: returns the bound names.
seed_block <- function(fx, i) {
  net <- fx$net
  loss_fn <- fx$loss_fn
  xs <- fx$xs
  ys <- fx$ys
  value <- with_autocast(device_type = "cpu", {
    output <- net(xs[[i]])
    loss <- loss_fn(output, ys[[i]])
  })
  list(output = output, loss = loss, value = value)
}

test_that("the seed's region crosses once and gives what the block run as written and torch.autocast give", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  n_on <- count_crossings(on <- seed_block(fx, 2L))
  withr::with_options(list(ampkit.fuse_regions = FALSE), n_off <- count_crossings(off <- seed_block(fx, 2L)))
  expect_identical(n_on, 1L)
  expect_identical(n_off, 4L)  # the control: enter, net(x), loss_fn(), exit
  for (name in names(on)) {
    expect_identical(dtype_name(on[[name]]), dtype_name(off[[name]]))
    expect_true(pt()$equal(on[[name]], off[[name]]))
  }
  expect_true(pt()$equal(on$value, on$loss))
  ns <- py_golden("
import torch
def oracle(net, loss_fn, x, y):
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = net(x)
        loss = loss_fn(out, y)
    return out, loss
")
  gold <- reticulate::py_call(ns$oracle, fx$net, fx$loss_fn, fx$xs[[2]], fx$ys[[2]])
  expect_identical(dtype_name(on$output), "bfloat16")
  expect_identical(dtype_name(on$loss), dtype_name(gold[1L]))
  expect_true(pt()$equal(on$output, gold[0L]))
  expect_true(pt()$equal(on$loss, gold[1L]))
  expect_false(is_autocast_enabled("cpu"))
  expect_identical(ampkit:::.h$open_regions(), 0L)
})

test_that("nested calls, named arguments, a reused name and a last call without a name fuse too", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  net <- fx$net
  loss_fn <- fx$loss_fn
  x <- fx$xs[[1]]
  y <- fx$ys[[1]]
  block <- function() {
    value <- with_autocast(device_type = "cpu", dtype = "bfloat16", {
      h <- net(x)
      h <- loss_fn(h, target = y)       # a name bound again: its new result from here on
      loss_fn(net(x), y)                 # nested, and the block's value
    })
    list(h = h, value = value)
  }
  n_on <- count_crossings(on <- block())
  withr::with_options(list(ampkit.fuse_regions = FALSE), n_off <- count_crossings(off <- block()))
  expect_identical(n_on, 1L)
  expect_identical(n_off, 6L)
  for (name in names(on)) expect_true(pt()$equal(on[[name]], off[[name]]))
  expect_identical(dtype_name(on$h), "float32")  # mse_loss runs in float32 under the policy
})

test_that("a block that does anything but module calls runs as written", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  net <- fx$net
  x <- fx$xs[[1]]
  my_forward <- function(x) net(x)  # the user's own R function
  blocks <- list(
    method = function() { with_autocast(device_type = "cpu", { out <- net(x$float()) }); out },
    base_function = function() { with_autocast(device_type = "cpu", { out <- net(x); invisible(NULL) }); out },
    user_function = function() { with_autocast(device_type = "cpu", { out <- my_forward(x) }); out },
    reticulate_call = function() { with_autocast(device_type = "cpu", { out <- pt()$relu(net(x)) }); out })
  for (name in names(blocks)) {
    n <- count_crossings(on <- blocks[[name]]())
    expect_gt(n, 1L)
    withr::with_options(list(ampkit.fuse_regions = FALSE), off <- blocks[[name]]())
    expect_true(pt()$equal(on, off), label = name)
    expect_identical(dtype_name(on), dtype_name(off))
  }
  expect_false(is_autocast_enabled("cpu"))
})

test_that("an argument that is a promise with a call in it is evaluated inside the region, as written", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  net <- fx$net
  a <- torch_randn(8, 16)
  w <- torch_randn(16, 16)
  f <- function(x) {
    with_autocast(device_type = "cpu", { out <- net(x) })
    x$dtype  # x was forced in the region: the matmul ran in bfloat16
  }
  expect_identical(sub("^torch\\.", "", reticulate::py_str(f(pt()$mm(a, w)))), "bfloat16")
  # a promise that only indexes (a step function's x = b[[1]]) is read early and fuses
  g <- function(x) count_crossings(with_autocast(device_type = "cpu", { out <- net(x) }))
  b <- list(a)
  expect_identical(g(b[[1]]), 1L)
})

test_that("an error in a later call binds the earlier results and raises what the block as written raises", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  net <- fx$net
  loss_fn <- fx$loss_fn
  x <- fx$xs[[1]]
  bad <- torch_randn(3, 5)  # no broadcast with the (8, 4) output
  run <- function() {
    output <- NULL
    err <- tryCatch(with_autocast(device_type = "cpu", {
      output <- net(x)
      loss <- loss_fn(output, bad)
    }), error = identity)
    list(err = err, output = output, loss_bound = exists("loss", inherits = FALSE))
  }
  on <- run()
  withr::with_options(list(ampkit.fuse_regions = FALSE), off <- run())
  expect_s3_class(on$err, "ampkit_python_error")
  expect_identical(class(on$err), class(off$err))
  expect_identical(conditionMessage(on$err), conditionMessage(off$err))
  expect_match(conditionMessage(on$err), "in an autocast region", fixed = TRUE)
  expect_false(is.null(on$output))
  expect_true(pt()$equal(on$output, off$output))
  expect_false(on$loss_bound)
  expect_false(is_autocast_enabled("cpu"))
  expect_identical(ampkit:::.h$open_regions(), 0L)
})

test_that("a bad region argument raises before the block runs, fused or not", {
  skip_if_no_ampkit()
  fx <- fuse_fixture()
  net <- fx$net
  x <- fx$xs[[1]]
  run <- function() {
    out <- NULL
    err <- tryCatch(with_autocast(device_type = "cpu", dtype = "float64x", { out <- net(x) }),
                    error = identity)
    list(err = err, out = out)
  }
  on <- run()
  withr::with_options(list(ampkit.fuse_regions = FALSE), off <- run())
  expect_s3_class(on$err, "ampkit_bad_dtype")
  expect_identical(conditionMessage(on$err), conditionMessage(off$err))
  expect_null(on$out)
  expect_false(is_autocast_enabled("cpu"))
})
