# The garbage watch (R/memory.R), on the CPU: the CUDA memory reading is
# simulated by the bytes of the model outputs that still hold memory in Python
# (tracked by a forward hook through weak references: an output is freed when
# Python frees it, or, through reticulate's crossing, when the release empties it).
# With the release of dropped outputs (on, as by default), a loop that writes
# `output <- net(x)` each step holds none of an earlier step's outputs; an output
# that R's garbage still references (`held <- list(output)`, rebound each step) is
# left to the watch's collections.

sim_py <- "
import weakref
outs = []
stats = {'max_n': 0}
def holding():
    return [t for t in (r() for r in outs) if t is not None and t.untyped_storage().nbytes() > 0]
def track(module, inputs, out):
    outs.append(weakref.ref(out))
    stats['max_n'] = max(stats['max_n'], len(holding()))
def live():
    return {'n': len(holding()), 'max_n': stats['max_n']}
def reading():
    # past 2^31, as on a GPU: reticulate wraps such ints
    return sum(t.untyped_storage().nbytes() for t in holding()) + 3 * 2**30
"

out_mb <- 16 * 256 * 4 / 2^20  # one fp32 output

# The seed's hand-written loop (fp32, or AMP with a scaler), `steps` steps; with `hold`,
# each step's output is also put in a list that the next step replaces, which R
# frees only when it collects (so its output too).
run_loop <- function(steps, threshold_mb, amp = FALSE, full_mb = 3 * out_mb, hold = FALSE) {
  sim <- py_ns(sim_py)
  torch_manual_seed(3)
  net <- nn_sequential(nn_linear(64, 256), nn_relu(), nn_linear(256, 256))  # output: 16 x 256 x 4 = 16 KiB
  hook <- net$register_forward_hook(sim$track)
  x <- torch_randn(16, 64)
  y <- torch_randn(16, 256)
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 0.01)
  scaler <- if (amp) amp_grad_scaler("cpu", init_scale = 2^8)
  ampkit:::.h$set_memory_reader(sim$reading)
  withr::defer(ampkit:::.h$set_memory_reader(NULL))
  withr::local_options(ampkit.gc_threshold_mb = threshold_mb, ampkit.gc_full_threshold_mb = full_mb)
  amp_gc()  # a fresh start: nothing of earlier tests in the reading
  before <- amp_gc()$collections
  held <- NULL
  for (i in seq_len(steps)) {
    if (amp) {
      with_autocast(device_type = "cpu", {
        output <- net(x)
        if (hold) held <- list(output)
        loss <- loss_fn(output, y)
      })
      scaler$scale(loss)$backward()
      scaler$step(opt)
      scaler$update()
    } else {
      output <- net(x)
      if (hold) held <- list(output)
      loss <- loss_fn(output, y)
      loss$backward()
      opt$step()
    }
    opt$zero_grad()
  }
  live <- reticulate::py_to_r(sim$live())
  list(max_live = live$max_n, live = live$n,
       collections = amp_gc()$collections - before)
}


test_that("a loop that drops its outputs holds none of an earlier step's, with no collection", {
  skip_if_no_ampkit()
  for (amp in c(FALSE, TRUE)) {
    # The watch off: the release alone frees each output once `output` is rebound (at
    # the loss call), so the hook of a forward sees the previous output still bound,
    # as in Python, where `output = net(x)` rebinds after the call; at the end, only
    # the last output holds memory.
    res <- run_loop(40, threshold_mb = Inf, amp = amp)
    expect_equal(res$collections, 0L)
    expect_lte(res$max_live, 2)
    expect_equal(res$live, 1)
  }
  # Control: without the release, every output holds its memory until R collects.
  withr::local_options(ampkit.release_outputs = FALSE)
  expect_gt(run_loop(40, threshold_mb = Inf)$max_live, 30)
})

test_that("outputs that R's garbage holds are freed by the watch, at most a threshold of them alive", {
  skip_if_no_ampkit()
  # Control: with the watch off, every output of the loop is still alive.
  off <- run_loop(40, threshold_mb = Inf, hold = TRUE)
  expect_equal(off$collections, 0L)
  expect_gt(off$max_live, 30)
  # A young-generation gc() after 4.5 outputs of growth, a full one after 3
  # outputs of leftovers (each collection leaves the output live at it).
  on <- run_loop(40, threshold_mb = 4.5 * out_mb, hold = TRUE)
  expect_gte(on$collections, 5L)
  expect_lte(on$max_live, 10)
  # Without the full collections, the leftovers pile up.
  young <- run_loop(80, threshold_mb = 4.5 * out_mb, full_mb = Inf, hold = TRUE)
  expect_gt(young$max_live, 10)
})

test_that("scaler$update() watches memory in an AMP loop too", {
  skip_if_no_ampkit()
  # bfloat16 outputs: 8 KiB each; zero_grad and update both read each step.
  on <- run_loop(30, threshold_mb = 4.5 * out_mb / 2, amp = TRUE, full_mb = 3 * out_mb / 2, hold = TRUE)
  expect_gte(on$collections, 4L)
  expect_lte(on$max_live, 10)
})

test_that("the reading is 0 on the CPU, so nothing is collected there", {
  skip_if_no_ampkit()
  skip_if(cuda_is_available(), "CUDA is available")
  expect_equal(ampkit:::memory_allocated(), 0)
  res <- amp_gc()
  expect_equal(res$allocated_before_mb, 0)
  expect_equal(res$allocated_after_mb, 0)
})

test_that("amp_gc() frees a tensor R dropped that a Python reference cycle still held", {
  skip_if_no_ampkit()
  ns <- reticulate::py_run_string(paste(
    "def cycle_holding_tensor():",
    "    import torch, weakref",
    "    t = torch.ones(1000)",
    "    box = [t]",
    "    box.append(box)  # a cycle: only Python's collector frees it",
    "    return box, weakref.ref(t)",
    "def alive(ref):",
    "    return ref() is not None", sep = "\n"), local = TRUE, convert = FALSE)
  pygc <- reticulate::import("gc")
  pygc$disable()  # no automatic collection of Python's while the test runs
  on.exit(pygc$enable(), add = TRUE)
  made <- ns$cycle_holding_tensor()  # (the cycle, a weak reference to its tensor), unconverted
  ref <- reticulate::py_get_item(made, 1L)
  alive <- function() reticulate::py_to_r(ns$alive(ref))
  made <- NULL
  gc(full = TRUE)  # R's collector alone: the cycle keeps the tensor
  expect_true(alive())
  amp_gc()
  expect_false(alive())
})

test_that("readings past 2^31 bytes reach R exactly", {
  skip_if_no_ampkit()
  # reticulate 1.28 wraps a Python int past 2^31 into an R integer (2**33 -> 0)
  ampkit:::.h$set_memory_reader(reticulate::py_eval("lambda: 5 * 2**30 + 512"))
  withr::defer(ampkit:::.h$set_memory_reader(NULL))
  expect_identical(ampkit:::memory_allocated(), 5 * 2^30 + 512)
  opt <- optim_sgd(nn_linear(2, 2)$parameters, lr = 0.1)
  withr::local_options(ampkit.gc_threshold_mb = Inf)
  assign("base", NA_real_, envir = ampkit:::.mem)
  opt$zero_grad()
  expect_identical(ampkit:::.mem$base, 5 * 2^30 + 512)
})

test_that("a bad gc threshold is an ampkit_error naming the option", {
  skip_if_no_ampkit()
  ampkit:::.h$set_memory_reader(reticulate::py_eval("lambda: 2**40"))
  withr::defer(ampkit:::.h$set_memory_reader(NULL))
  withr::local_options(ampkit.gc_threshold_mb = "big")
  opt <- optim_sgd(nn_linear(2, 2)$parameters, lr = 0.1)
  assign("base", 0, envir = ampkit:::.mem)
  expect_error(opt$zero_grad(), class = "ampkit_bad_argument", regexp = "ampkit.gc_threshold_mb")
})

test_that("a CUDA out-of-memory error collects R's garbage and says so", {
  skip_if_no_ampkit()
  sim <- py_ns(paste(sim_py, "
import torch
def oom(x):
    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
", sep = "\n"))
  net <- nn_linear(64, 256)
  net$register_forward_hook(sim$track)
  ampkit:::.h$set_memory_reader(sim$reading)
  withr::defer(ampkit:::.h$set_memory_reader(NULL))
  withr::local_options(ampkit.gc_threshold_mb = Inf)
  x <- torch_randn(4, 64)
  for (i in 1:5) held <- list(net(x))  # each output held by a list R frees when it collects
  held <- NULL
  expect_equal(reticulate::py_to_r(sim$live())$n, 5)
  oom <- sim$oom
  err <- expect_error(with_autocast(device_type = "cpu", oom(x)),
                      class = "ampkit_py_OutOfMemoryError")
  expect_s3_class(err, "ampkit_out_of_memory")
  expect_match(conditionMessage(err), "collected garbage.*not retried: R code ran in it")
  expect_equal(reticulate::py_to_r(sim$live())$n, 0)
  expect_false(is_autocast_enabled("cpu"))
})

# Whether a step's logits are still alive when backward reaches them: Python's loop,
# `loss = loss_fn(net(x), y)`, has freed them by then when nothing saved them (here a
# loss that saves none of its input); R's loop written the same way holds them in the R
# object of `net(x)` until it lets go of them. A tensor hook on the output records, as
# backward reaches it, whether the output is still alive (a weak reference).
alive_py <- "
import weakref, torch
seen = []
def track(module, inputs, out):
    ref = weakref.ref(out)
    out.register_hook(lambda g: seen.append(ref() is not None))
class SumLoss(torch.nn.Module):
    def forward(self, out, y):
        return (out * 2.0).sum()
def python_step():
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    net.register_forward_hook(track)
    loss_fn = SumLoss()
    loss = loss_fn(net(torch.randn(4, 8)), torch.randn(4, 32))
    loss.backward()
    return seen[-1]
"

alive_in_backward <- function(scaled) {
  ns <- py_ns(alive_py)
  python <- reticulate::py_to_r(reticulate::py_call(ns$python_step))
  torch_manual_seed(5)
  net <- nn_sequential(nn_linear(8, 32), nn_relu(), nn_linear(32, 32))
  hook <- net$register_forward_hook(ns$track)
  x <- torch_randn(4, 8)
  y <- torch_randn(4, 32)
  loss_fn <- reticulate::py_to_r(reticulate::py_call(ns$SumLoss))  # a module call from R
  scaler <- amp_grad_scaler("cpu", init_scale = 2^4)
  for (i in 1:3) {
    loss <- loss_fn(net(x), y)
    if (scaled) scaler$scale(loss)$backward() else loss$backward()
  }
  list(python = python, r = unlist(reticulate::py_to_r(ns$seen))[-1])  # R's three steps
}

test_that("an output R dropped is let go before backward, as Python's loop has freed it", {
  skip_if_no_ampkit()
  skip_if_not(isTRUE(ampkit:::.x$on),
              "the compiled crossing is off: reticulate's path lets go at the next module call only")
  for (scaled in c(FALSE, TRUE)) {
    res <- alive_in_backward(scaled)
    expect_false(res$python)  # the oracle: Python's loop has freed the output
    expect_identical(res$r, rep(res$python, 3))
  }
  # Control: without the release, R's object of `net(x)` holds it through backward.
  withr::local_options(ampkit.release_outputs = FALSE)
  expect_identical(alive_in_backward(FALSE)$r, rep(TRUE, 3))
})
