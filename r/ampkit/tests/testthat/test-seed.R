# The seed's walkthrough runs as written with library(ampkit), on the CPU
# with only its device strings and sizes changed, and every loss it ends on
# equals the same walkthrough driven from Python.
test_that("the seed walkthrough runs on the CPU with only device strings and sizes changed", {
  skip_if_no_ampkit()
  # With a GPU, the seed's $cuda() moves the model there while the data stays on the CPU;
  # the next test runs the walkthrough on that GPU instead.
  skip_if(cuda_is_available(), "CUDA is available: the GPU walkthrough test covers this machine")
  sizes <- c(batch_size = 8, in_size = 16, out_size = 16, num_layers = 3, num_batches = 3, epochs = 2)
  chunks <- seed_chunks("cpu", sizes)
  expect_equal(names(chunks), c("setup", "data", "model", "fp32", "autocast", "scaler", "benchmark"))
  # 5 lines with a device string, 5 size lines (num_layers stays 3): nothing else changed
  expect_equal(attr(chunks, "changed"), 5 + 5)

  env <- new.env(parent = globalenv())
  moved <- 0
  run_chunk <- function(name) {
    withCallingHandlers(
      source(exprs = parse(text = chunks[[name]]), local = env, print.eval = TRUE),
      ampkit_cuda_unavailable = function(w) {
        moved <<- moved + 1
        invokeRestart("muffleWarning")
      },
      # cuda_amp_grad_scaler() on the CPU: disabled by the core, with a warning
      ampkit_python_warning = function(w) invokeRestart("muffleWarning"))
  }
  losses <- numeric()
  for (name in c("setup", "data", "model", "fp32", "autocast", "scaler")) {
    run_chunk(name)
    if (name %in% c("fp32", "autocast", "scaler")) losses[[name]] <- env$loss$item()
  }
  expect_length(env$data, 3)
  expect_equal(dtype_name(env$output), "bfloat16")
  expect_s3_class(env$scaler, "ampkit_grad_scaler")
  # the benchmark chunk prints three system.time() results
  out <- capture.output(run_chunk("benchmark"))
  expect_equal(sum(grepl("elapsed", out)), 3)
  for (v in list(c(FALSE, FALSE), c(TRUE, FALSE), c(TRUE, TRUE))) {
    losses[[paste0("run_", v[1], "_", v[2])]] <-
      withCallingHandlers(env$run(autocast = v[1], scale = v[2]),
                          ampkit_cuda_unavailable = function(w) invokeRestart("muffleWarning"),
                          ampkit_python_warning = function(w) invokeRestart("muffleWarning"))
  }
  if (!cuda_is_available()) expect_gt(moved, 0)
  expect_type(losses, "double")
  expect_true(all(is.finite(losses)))

  gold <- py_golden(paste0(seed_walkthrough_py("cpu", sizes), "
losses = [run(False, None), run(True, None), run(True, True),
          run(False, False), run(True, False), run(True, True),
          run(False, False), run(True, False), run(True, True)]
"))
  # the R walkthrough: 3 loops, 3 timed run()s, 3 run()s here
  expect_identical(unname(losses), unlist(gold$losses)[c(1:3, 7:9)])
  # autocast changed the numbers (bfloat16), so the comparison is not vacuous
  expect_false(identical(losses[["fp32"]], losses[["autocast"]]))
})

test_that("the seed walkthrough runs unchanged on a GPU", {
  skip_if_no_cuda()
  sizes <- c(batch_size = 64, in_size = 128, out_size = 128, num_layers = 3, num_batches = 4, epochs = 2)
  chunks <- seed_chunks("cuda", sizes)
  env <- new.env(parent = globalenv())
  for (name in c("setup", "data", "model", "fp32", "autocast", "scaler")) {
    source(exprs = parse(text = chunks[[name]]), local = env, print.eval = TRUE)
  }
  expect_equal(dtype_name(env$output), "float16")
  expect_true(env$scaler$is_enabled())
  expect_true(is.finite(env$loss$item()))
})
