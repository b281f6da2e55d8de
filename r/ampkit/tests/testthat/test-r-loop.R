# The seed's AMP loop written in R (with_autocast() blocks, scaler$scale(loss)$backward(),
# scaler$step(opt), scaler$update()): same results as the loop in Python, no tensors of
# earlier steps kept alive, out-of-memory errors retried once, mlverse's argument order.

# `each(step)` runs after every step (for counting).
r_seed_loop <- function(steps, autocast = TRUE, scale = TRUE, seed = 11, each = NULL) {
  torch_manual_seed(seed)
  xs <- lapply(1:4, function(i) torch_randn(8, 16))
  ys <- lapply(1:4, function(i) torch_randn(8, 4))
  net <- nn_sequential(nn_linear(16, 32), nn_relu(), nn_linear(32, 4))
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 0.05)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10, growth_interval = 3, enabled = scale)
  losses <- numeric(steps)
  for (s in seq_len(steps)) {
    i <- (s - 1L) %% 4L + 1L
    with_autocast(device_type = "cpu", enabled = autocast, {
      output <- net(xs[[i]])
      loss <- loss_fn(output, ys[[i]])
    })
    losses[[s]] <- loss$item()
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    opt$zero_grad()
    if (!is.null(each)) each(s)
  }
  list(losses = losses, scale = scaler$get_scale(), net = net)
}

py_seed_loop <- "
import torch, ampkit.r_bridge
def loop(steps, autocast, scale, seed=11):
    torch.manual_seed(seed)
    xs = [torch.randn(8, 16) for _ in range(4)]
    ys = [torch.randn(8, 4) for _ in range(4)]
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    losses, scaler = ampkit.r_bridge.amp_loop(
        net, list(zip(xs, ys)), 'cpu', autocast, scale, steps, lr=0.05,
        scaler_kwargs=dict(init_scale=2.0**10, growth_interval=3), record=True)
    return losses, scaler.get_scale(), [p.detach().clone() for p in net.parameters()]
"

test_that("the R seed loop gives Python's losses, scale and parameters, bit for bit", {
  skip_if_no_ampkit()
  ns <- py_golden(paste0(py_seed_loop, "\nres = {(a, s): loop(10, a, s) for a in (False, True) for s in (False, True)}\n"))
  gold <- reticulate::py_eval(paste0("(lambda: (exec(", deparse(py_seed_loop), ", g := {}), g['loop'])[1])()"),
                              convert = FALSE)
  for (v in list(c(FALSE, FALSE), c(TRUE, FALSE), c(TRUE, TRUE))) {
    r <- r_seed_loop(10, autocast = v[1], scale = v[2])
    py <- reticulate::py_call(gold, 10L, v[1], v[2])
    py_losses <- reticulate::py_to_r(py[0L])
    expect_identical(r$losses, unlist(py_losses))
    expect_identical(r$scale, reticulate::py_to_r(py[1L]))
    params <- unname(r$net$parameters)
    for (k in seq_along(params)) {
      expect_true(pt()$equal(params[[k]], py[2L][k - 1L]))
    }
  }
  # autocast changes the numbers, so the comparison is not vacuous
  expect_false(identical(r_seed_loop(3, FALSE, FALSE)$losses, r_seed_loop(3, TRUE, FALSE)$losses))
})

test_that("a step of the R loop leaves no tensors of earlier steps alive", {
  skip_if_no_ampkit()
  bridge <- reticulate::import("ampkit.r_bridge")
  count <- bridge$live_tensor_count
  # The CUDA reading of the garbage watch, simulated on the CPU: 1 MiB per live tensor.
  bridge$set_memory_reader(reticulate::py_eval("lambda f: (lambda: f() * 2**20)")(bridge$live_tensor_count))
  withr::defer(bridge$set_memory_reader(NULL))
  run <- function(steps, threshold_mb) {
    withr::local_options(ampkit.gc_threshold_mb = threshold_mb)
    amp_gc()
    live <- integer(steps)
    r_seed_loop(steps, each = function(s) live[[s]] <<- count())
    live
  }
  # With the watch collecting on any growth (both thresholds 0: R's young collections
  # alone do not free outputs that one of R's own collections promoted while they were
  # live), the number of live tensors stays flat over 20 steps.
  withr::local_options(ampkit.gc_full_threshold_mb = 0)
  on <- run(20, 0)
  expect_lte(max(on[3:20]) - min(on[3:20]), 2)
  # Control: with the watch off, the outputs of the steps pile up until R collects.
  off <- run(20, Inf)
  expect_gt(max(off), max(on) + 10)
})

test_that("a step of the R loop frees the earlier steps' outputs without any collection", {
  skip_if_no_ampkit()
  bridge <- reticulate::import("ampkit.r_bridge")
  bytes <- bridge$live_tensor_bytes
  withr::local_options(ampkit.gc_threshold_mb = Inf)  # the garbage watch off: no collection
  # The seed's AMP loop, bigger tensors (an output: 64 x 256 bfloat16, 32 KiB).
  loop <- function(steps, keep_at = 0L) {
    amp_gc()
    torch_manual_seed(5)
    xs <- lapply(1:4, function(i) torch_randn(64, 128))
    ys <- lapply(1:4, function(i) torch_randn(64, 256))
    net <- nn_sequential(nn_linear(128, 256), nn_relu(), nn_linear(256, 256))
    loss_fn <- nn_mse_loss()
    opt <- optim_sgd(net$parameters, lr = 0.01)
    scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
    live <- numeric(steps)
    kept <- list()
    for (s in seq_len(steps)) {
      i <- (s - 1L) %% 4L + 1L
      with_autocast(device_type = "cpu", {
        output <- net(xs[[i]])
        loss <- loss_fn(output, ys[[i]])
      })
      if (s == keep_at) {  # tensors the user keeps must stay valid
        kept <- list(output = output, copy = output$clone(), loss = loss, loss_value = loss$item())
      }
      scaler$scale(loss)$backward()
      scaler$step(opt)
      scaler$update()
      opt$zero_grad()
      live[[s]] <- bytes()
    }
    list(live = live, kept = kept)
  }
  on <- loop(20, keep_at = 6L)
  out_bytes <- 64 * 256 * 2
  # Flat but for the tensors kept at step 6: each step's outputs are freed once the
  # next step rebinds `output` and `loss` (the loss one step later), so the kept
  # output, its copy and the kept loss show from steps 6, 7 and 8 on.
  expect_lte(max(on$live[3:5]) - min(on$live[3:5]), 0)
  expect_lte(max(on$live[8:20]) - min(on$live[8:20]), 0)
  # The tensors kept at step 6 are intact 14 steps later.
  expect_identical(on$kept$output$numel(), 64L * 256L)
  expect_true(on$kept$output$equal(on$kept$copy))
  expect_identical(on$kept$loss$item(), on$kept$loss_value)
  # Control: without the release, every step leaves its outputs to R's collector.
  withr::local_options(ampkit.release_outputs = FALSE)
  off <- loop(20)
  expect_gt(off$live[[20]] - off$live[[3]], 15 * out_bytes)
})

# How the outputs of a module's earlier calls stand when it is called again, recorded by
# a forward pre-hook (in Python, so that R holds no reference): "dead" (Python freed the
# tensor), "empty" (its memory freed, the object alive until R collects its wrapper) or
# "live" (its memory held). The same loop in Python is the oracle.
outputs_watch_py <- "
import weakref, torch, ampkit
def state(r):
    t = r()
    return 'dead' if t is None else 'empty' if t.untyped_storage().nbytes() == 0 else 'live'
def watch(net):
    outs, seen = [], []
    net.register_forward_pre_hook(lambda m, i: seen.append([state(r) for r in outs]))
    net.register_forward_hook(lambda m, i, out: outs.append(weakref.ref(out)))
    return seen
def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
def loop(xs, ys, steps, amp, seed=9):
    net = build(seed)
    seen = watch(net)
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = ampkit.GradScaler('cpu', init_scale=2.0**10)
    def step(x, y):
        with ampkit.autocast('cpu', enabled=amp):
            output = net(x)
            loss = loss_fn(output, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss
    losses = [step(xs[s % 4], ys[s % 4]) for s in range(steps)]
    return [l.item() for l in losses], seen
"

test_that("a step written as a function frees its output before the next step's forward, as Python does", {
  skip_if_no_ampkit()
  ns <- py_ns(outputs_watch_py)
  withr::local_options(ampkit.gc_threshold_mb = Inf)  # the garbage watch off: no collection
  torch_manual_seed(4)
  xs <- lapply(1:4, function(i) torch_randn(8, 16))
  ys <- lapply(1:4, function(i) torch_randn(8, 32))
  r_loop <- function(steps, amp) {
    torch_manual_seed(9)  # the oracle's build(9)
    net <- nn_sequential(nn_linear(16, 64), nn_relu(), nn_linear(64, 32))
    seen <- ns$watch(net)
    loss_fn <- nn_mse_loss()
    opt <- optim_sgd(net$parameters, lr = 0.01)
    scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
    # the seed's step in a function: `output` goes when the step returns
    step <- function(x, y) {
      with_autocast(device_type = "cpu", enabled = amp, {
        output <- net(x)
        loss <- loss_fn(output, y)
      })
      scaler$scale(loss)$backward()
      scaler$step(opt)
      scaler$update()
      opt$zero_grad()
      loss
    }
    losses <- vector("list", steps)
    for (s in seq_len(steps)) losses[[s]] <- step(xs[[(s - 1L) %% 4L + 1L]], ys[[(s - 1L) %% 4L + 1L]])
    list(losses = vapply(losses, function(l) l$item(), numeric(1)),
         seen = reticulate::py_to_r(seen))
  }
  crossings <- if (ampkit:::crossing_status()$on) c(TRUE, FALSE) else FALSE
  withr::defer(ampkit:::use_crossing(crossings[[1]]))
  for (amp in c(TRUE, FALSE)) {
    py <- reticulate::py_to_r(ns$loop(xs, ys, 8L, amp))
    py_seen <- py[[2]]
    # the oracle: Python has freed every earlier output when the next forward starts
    expect_identical(unique(unlist(py_seen)), "dead")
    for (compiled in crossings) {
      ampkit:::use_crossing(compiled)
      r <- r_loop(8L, amp)
      expect_identical(r$losses, unlist(py[[1]]))
      expect_identical(lengths(r$seen), lengths(py_seen))
      if (compiled) {
        # the compiled crossing lets go of R's reference: Python frees the tensor itself
        expect_identical(r$seen, py_seen)
      } else {
        # reticulate's path empties it (its wrapper goes when R collects)
        expect_true(all(unlist(r$seen) %in% c("dead", "empty")))
      }
    }
  }
  # Control: without the release, the earlier outputs are live until R collects.
  withr::local_options(ampkit.release_outputs = FALSE)
  ampkit:::use_crossing(crossings[[1]])
  off <- r_loop(8L, TRUE)
  expect_true("live" %in% unlist(off$seen))
})

test_that("a collection of the garbage watch at every step leaves the release to free each output", {
  skip_if_no_ampkit()
  skip_if_not(ampkit:::crossing_status()$on, "the compiled crossing is not in use (reticulate's rings forget at a collection)")
  ns <- py_ns(paste(outputs_watch_py, "
import itertools
ticks = itertools.count()
def growing():  # 2 GiB more at every reading: the watch collects at each
    return float(next(ticks) * 2**31)
", sep = "\n"))
  ampkit:::.h$set_memory_reader(ns$growing)
  withr::defer(ampkit:::.h$set_memory_reader(NULL))
  withr::local_options(ampkit.gc_threshold_mb = 1, ampkit.gc_full_threshold_mb = 1e9)
  torch_manual_seed(4)
  xs <- lapply(1:4, function(i) torch_randn(8, 16))
  ys <- lapply(1:4, function(i) torch_randn(8, 32))
  net <- nn_sequential(nn_linear(16, 64), nn_relu(), nn_linear(64, 32))
  seen <- ns$watch(net)
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 0.01)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
  step <- function(x, y) {
    with_autocast(device_type = "cpu", {
      output <- net(x)
      loss <- loss_fn(output, y)
    })
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    opt$zero_grad()  # collects while `output` is still bound
    loss
  }
  before <- amp_gc()$collections
  losses <- vector("list", 8)
  for (s in 1:8) losses[[s]] <- step(xs[[(s - 1L) %% 4L + 1L]], ys[[(s - 1L) %% 4L + 1L]])
  expect_gte(amp_gc()$collections - before, 8L)
  expect_identical(unique(unlist(reticulate::py_to_r(seen))), "dead")
})

oom_py <- "
import torch
calls = {'n': 0}
def flaky(times):
    def f(*args, **kwargs):
        calls['n'] += 1
        if calls['n'] <= times:
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (simulated)')
        return 42.0
    return f
collected = {'n': 0}
"

test_that("an out-of-memory error collects garbage and retries the call once", {
  skip_if_no_ampkit()
  ns <- reticulate::py_dict(list(), list(), convert = FALSE)
  reticulate::import_builtins(convert = FALSE)$exec(oom_py, ns)
  bridge <- reticulate::import("ampkit.r_bridge")
  # R's collector, as the package sets it, counting its calls
  r_collections <- 0L
  bridge$set_r_collector(function() {
    r_collections <<- r_collections + 1L
    gc(full = TRUE)
    invisible(NULL)
  })
  withr::defer(ampkit:::py_reset_collector())

  # A tensor method that runs out of memory once succeeds after one collection.
  t <- torch_randn(3)
  flaky <- reticulate::py_call(ns[["flaky"]], 1L)
  reticulate::py_set_attr(pt()$Tensor, "ampkit_test_flaky", reticulate::py_eval("lambda f: (lambda self: f())")(flaky))
  withr::defer(reticulate::py_del_attr(pt()$Tensor, "ampkit_test_flaky"))
  expect_equal(t$ampkit_test_flaky(), 42)
  expect_equal(reticulate::py_to_r(ns[["calls"]])$n, 2)  # failed, then retried
  expect_equal(r_collections, 1L)

  # Out of memory twice: one retry, then a condition of class ampkit_out_of_memory.
  reticulate::py_set_item(ns[["calls"]], "n", 0L)
  reticulate::py_set_attr(pt()$Tensor, "ampkit_test_flaky",
                          reticulate::py_eval("lambda f: (lambda self: f())")(reticulate::py_call(ns[["flaky"]], 5L)))
  err <- expect_error(t$ampkit_test_flaky(), class = "ampkit_out_of_memory")
  expect_s3_class(err, "ampkit_error")
  expect_s3_class(err, "ampkit_py_OutOfMemoryError")
  expect_equal(reticulate::py_to_r(ns[["calls"]])$n, 2)  # retried once, not more
  expect_equal(r_collections, 2L)
  expect_match(conditionMessage(err), "$ampkit_test_flaky(): out of memory twice", fixed = TRUE)
  expect_match(conditionMessage(err), "Tried to allocate 2.00 GiB", fixed = TRUE)

  # The scaler's calls and the train step go through the same retry.
  reticulate::py_set_item(ns[["calls"]], "n", 0L)
  expect_equal(ampkit:::.h$retry_call(reticulate::py_call(ns[["flaky"]], 1L)), 42)
  expect_equal(r_collections, 3L)

  # Other errors are not retried.
  reticulate::py_set_attr(pt()$Tensor, "ampkit_test_flaky", reticulate::py_eval("lambda self: 1/0"))
  expect_error(t$ampkit_test_flaky(), class = "ampkit_py_ZeroDivisionError")
  expect_equal(r_collections, 3L)
})

test_that("local_autocast() and with_autocast() take mlverse torch's argument order", {
  skip_if_no_ampkit()
  expect_identical(names(formals(local_autocast))[1:5],
                   c("device_type", "dtype", "enabled", "cache_enabled", "..."))
  expect_identical(names(formals(with_autocast))[1:6],
                   c("code", "...", "device_type", "dtype", "enabled", "cache_enabled"))
  net <- nn_linear(4, 2)
  x <- torch_randn(3, 4)
  f <- function(dtype) {
    local_autocast("cpu", dtype)
    c(get_autocast_dtype("cpu"), dtype_name(net(x)))
  }
  expect_identical(f(torch_float16()), c("float16", "float16"))
  expect_identical(f(torch_bfloat16()), c("bfloat16", "bfloat16"))
  g <- function() {
    local_autocast("cpu", torch_bfloat16(), FALSE)
    is_autocast_enabled("cpu")
  }
  expect_false(g())
  # with_autocast: the named form of mlverse, and local_autocast()'s order with the code last
  expect_identical(with_autocast(device_type = "cpu", dtype = torch_float16(), dtype_name(net(x))), "float16")
  expect_identical(with_autocast("cpu", torch_float16(), dtype_name(net(x))), "float16")
  expect_identical(with_autocast("cpu", torch_float16(), FALSE, dtype_name(net(x))), "float32")
  with_autocast("cpu", torch_float16(), {
    y <- net(x)
  })
  expect_equal(dtype_name(y), "float16")
  expect_false(is_autocast_enabled("cpu"))
})

test_that("with_autocast(code = function() ...) runs the function in the region", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  x <- torch_randn(3, 4)
  out <- with_autocast(device_type = "cpu", code = function() net(x))
  expect_s3_class(out, "torch.Tensor")
  expect_equal(dtype_name(out), "bfloat16")
  expect_false(is_autocast_enabled("cpu"))
})

# Steps of the seed's AMP loop on `net`; the scaler's reads after each update.
scaler_reads <- function(steps, defer) {
  withr::local_options(ampkit.defer_update = defer)
  torch_manual_seed(3)
  net <- nn_sequential(nn_linear(16, 32), nn_relu(), nn_linear(32, 4))
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 0.05)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^10, growth_interval = 1)
  x <- torch_randn(8, 16)
  y <- torch_randn(8, 4)
  reads <- list()
  for (s in seq_len(steps)) {
    with_autocast(device_type = "cpu", {
      loss <- loss_fn(net(x), y)
    })
    scaler$scale(loss)$backward()
    scaler$step(opt)
    scaler$update()
    # each read right after the update, before any other call
    reads[[s]] <- switch((s - 1L) %% 4L + 1L,
                         scaler$get_scale(),
                         scaler$py$get_scale(),
                         scaler$state_dict()$scale,
                         scaler$stats()$steps)
    opt$zero_grad()
  }
  list(reads = reads, weight = net$parameters[[1]])
}

test_that("a deferred $update() is made before anything reads the scaler", {
  skip_if_no_ampkit()
  on <- scaler_reads(8, defer = TRUE)
  off <- scaler_reads(8, defer = FALSE)  # the control: each update made at once
  expect_identical(on$reads, off$reads)
  expect_true(pt()$equal(on$weight, off$weight))
  # growth_interval = 1: the scale grew at every step, so the reads saw the updates
  expect_identical(on$reads[[1]], 2^11)
  expect_identical(on$reads[[5]], 2^15)
})

test_that("$update() and the next call into Python share one crossing", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu", init_scale = 2^8, growth_interval = 1)
  count <- function(defer) {
    withr::local_options(ampkit.defer_update = defer)
    scaler$scale(net(torch_randn(3, 4))$sum())$backward()
    scaler$step(opt)
    crossings({
      scaler$update()
      opt$zero_grad()
    })
  }
  expect_identical(count(TRUE), 1L)
  expect_identical(count(FALSE), 2L)  # the control
  expect_identical(scaler$get_scale(), 2^10)
  # A deferred update left pending runs before the next read, in its own crossing.
  scaler$scale(net(torch_randn(3, 4))$sum())$backward()
  scaler$step(opt)
  scaler$update()
  n <- crossings(expect_identical(scaler$get_scale(), 2^11))
  expect_identical(n, 1L)  # the flush (get_scale() itself is reticulate's call)
  opt$zero_grad()
})

test_that("an update that cannot be deferred raises at $update()", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  opt <- optim_sgd(net$parameters, lr = 0.1)
  scaler <- amp_grad_scaler("cpu")
  # no step since the last update: the core's error, from $update() itself
  err <- expect_error(scaler$update(), class = "ampkit_python_error")
  expect_match(conditionMessage(err), "^\\$update\\(\\): Python raised RuntimeError: update\\(\\)")
  scaler$scale(net(torch_randn(3, 4))$sum())$backward()
  scaler$step(opt)
  scaler$update()
  err <- expect_error(scaler$update(), class = "ampkit_python_error")  # twice
  expect_match(conditionMessage(err), "no optimizer was stepped")
})

test_that("losses kept by batch are freed once the next epoch replaces them, without any collection", {
  skip_if_no_ampkit()
  bridge <- reticulate::import("ampkit.r_bridge")
  bytes <- bridge$live_tensor_bytes
  withr::local_options(ampkit.gc_threshold_mb = Inf)  # the garbage watch off
  # The benchmark runner's loop: `losses[[i]] <- loss`, 12 batches (more outputs than the
  # first ring watches), so each loss leaves it while the list still holds it.
  loop <- function(steps, nb = 12L) {
    amp_gc()
    torch_manual_seed(7)
    xs <- lapply(seq_len(nb), function(i) torch_randn(64, 128))
    ys <- lapply(seq_len(nb), function(i) torch_randn(64, 256))
    net <- nn_sequential(nn_linear(128, 256), nn_relu(), nn_linear(256, 256))
    loss_fn <- nn_mse_loss()
    opt <- optim_sgd(net$parameters, lr = 0.01)
    scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
    losses <- vector("list", nb)
    live <- numeric(steps)
    for (s in seq_len(steps)) {
      i <- (s - 1L) %% nb + 1L
      with_autocast(device_type = "cpu", {
        output <- net(xs[[i]])
        loss <- loss_fn(output, ys[[i]])
      })
      scaler$scale(loss)$backward()
      scaler$step(opt)
      scaler$update()
      opt$zero_grad()
      losses[[i]] <- loss
      live[[s]] <- bytes()
    }
    list(live = live, values = vapply(losses, function(l) l$item(), 0))
  }
  # What a loss holds (torch's mse_loss on the CPU keeps the batch's squared errors)
  per_loss <- pt()$nn$functional$mse_loss(torch_randn(64, 256), torch_randn(64, 256))$untyped_storage()$nbytes()
  on <- loop(60)
  # Once the second epoch replaces losses (the first scan that frees some comes a few
  # steps into it: scans that freed nothing in the first epoch spaced out), the list
  # holds 12 losses and at most a scan's worth of replaced ones wait: flat within that.
  expect_lte(max(on$live[32:60]) - min(on$live[32:60]), 5 * per_loss)
  # Control: without the release, the replaced losses pile up until R collects.
  withr::local_options(ampkit.release_outputs = FALSE)
  off <- loop(60)
  expect_gt(off$live[[60]] - off$live[[32]], 12 * per_loss)
  # the losses are the same numbers either way
  expect_identical(on$values, off$values)
})

test_that("an object passed every step is wrapped for Python once, and still frees when dropped", {
  skip_if_no_ampkit()
  x <- torch_randn(2, 3)
  a <- ampkit:::py_arg(x)
  expect_identical(ampkit:::py_arg(x), a)  # the same carrier, kept with the object
  # the carrier points to the object's Python tensor: a call through it sees x
  expect_true(reticulate::py_to_r(ampkit:::.h$call(ampkit:::py_fn(pt()$equal), list(a, a), NULL)))
  # and it adds nothing to R's reference count of x, which the release reads
  refcount <- eval(str2lang("function(e) .Internal(refcnt(e))"), baseenv())
  y <- torch_randn(2, 3)
  n0 <- refcount(y)
  invisible(ampkit:::py_arg(y))
  expect_identical(refcount(y), n0)
  keep <- list(y)  # the control: a real reference counts
  expect_gt(refcount(y), n0)
})

test_that("a loop that keeps every loss keeps them intact, and its scans space out", {
  skip_if_no_ampkit()
  torch_manual_seed(9)
  x <- torch_randn(8, 16)
  y <- torch_randn(8, 4)
  net <- nn_sequential(nn_linear(16, 32), nn_relu(), nn_linear(32, 4))
  loss_fn <- nn_mse_loss()
  opt <- optim_sgd(net$parameters, lr = 0.01)
  amp_gc()
  kept <- list()
  values <- numeric(0)
  for (s in 1:200) {
    with_autocast(device_type = "cpu", {
      loss <- loss_fn(net(x), y)
    })
    values[[s]] <- loss$item()
    loss$backward()
    opt$step()
    opt$zero_grad()
    kept[[s]] <- loss
  }
  # every kept loss still holds its value (none was freed under the list)
  expect_identical(vapply(kept, function(l) l$item(), 0), values)
  # nothing to free: the second ring is scanned at the longest interval
  expect_identical(ampkit:::.rel$every, ampkit:::RELEASE_EVERY_MAX)
})
