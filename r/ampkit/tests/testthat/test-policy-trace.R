test_that("amp_policy() lists the spec's tables as a data.frame of op, device and category", {
  skip_if_no_ampkit()
  skip_if_no_repo()
  f <- file.path(repo_dir(), "shared_specs", "policies", "torch_default.yaml")
  spec <- yaml::read_yaml(f)
  p <- amp_policy("torch_default")
  expect_s3_class(p, "ampkit_policy")
  tab <- as.data.frame(p)
  expect_equal(names(tab), c("op", "device", "category"))
  for (dev in names(spec$devices)) {
    for (cat in c("lower_precision_fp", "fp32", "fp32_output", "promote")) {
      expect_setequal(tab$op[tab$device == dev & tab$category == cat], as.character(unlist(spec$devices[[dev]][[cat]])))
    }
    expect_setequal(tab$op[tab$device == dev & tab$category == "banned"], names(spec$devices[[dev]]$banned))
    expect_equal(attr(tab, "lower_precision_dtype")[[dev]], spec$devices[[dev]]$lower_precision_dtype)
  }
  expect_output(print(p), "torch_default")
})

test_that("overrides return a new policy and change what a region does", {
  skip_if_no_ampkit()
  p <- amp_policy("torch_default")
  q <- amp_policy(p, fp32 = c("linear", "matmul"), device = "cpu")
  tq <- as.data.frame(q)
  tp <- as.data.frame(p)
  expect_equal(tq$category[tq$op == "linear" & tq$device == "cpu"], "fp32")
  expect_equal(tq$category[tq$op == "linear" & tq$device == "cuda"], "lower_precision_fp")
  expect_equal(tp$category[tp$op == "linear" & tp$device == "cpu"], "lower_precision_fp")
  net <- nn_linear(4, 2)
  x <- torch_randn(3, 4)
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = q, net(x))), "float32")
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = p, net(x))), "bfloat16")
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = "torch_default", net(x))), "bfloat16")
})

test_that("bad policies and overrides are R conditions that say what is valid", {
  skip_if_no_ampkit()
  err <- expect_error(amp_policy("no_such_policy"), class = "ampkit_python_error")
  expect_match(conditionMessage(err), "no shipped policy named 'no_such_policy'")
  err <- expect_error(amp_policy("torch_default", fp16 = "linear"), class = "ampkit_error")
  expect_match(conditionMessage(err), "lower_precision_fp")
  expect_error(amp_policy("torch_default", "linear"), class = "ampkit_bad_argument")
  expect_error(amp_policy("torch_default", fp32 = "linear", device = "gpu"), class = "ampkit_bad_device")
  expect_error(amp_policy(42), class = "ampkit_bad_argument")
  expect_error(with_autocast(device_type = "cpu", policy = 42, 1), class = "ampkit_bad_argument")
})

test_that("a region given a shipped policy's name loads it once; a path is read every time", {
  skip_if_no_ampkit()
  # count the loads that R asks of the core
  ak <- reticulate::import("ampkit", convert = FALSE)
  original <- ak$load_policy
  calls <- reticulate::py_eval("[]", convert = FALSE)
  counting <- reticulate::py_eval("lambda f, calls: (lambda p: (calls.append(p), f(p))[1])")(original, calls)
  reticulate::py_set_attr(ak, "load_policy", counting)
  withr::defer(reticulate::py_set_attr(ak, "load_policy", original))
  n_calls <- function() reticulate::py_len(calls)
  reticulate::import("ampkit.r_bridge")$clear_policy_cache()

  net <- nn_linear(4, 2)
  x <- torch_randn(3, 4)
  for (i in 1:3) {
    expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = "torch_default", net(x))), "bfloat16")
  }
  expect_equal(n_calls(), 1)
  # a bad name raises its condition every time (failures are not kept)
  for (i in 1:2) {
    err <- expect_error(with_autocast(device_type = "cpu", policy = "no_such_policy", 1),
                        class = "ampkit_python_error")
    expect_match(conditionMessage(err), "no shipped policy named 'no_such_policy'")
  }
  expect_equal(n_calls(), 3)
  # a file may change between regions: the region follows it
  text <- reticulate::py_to_r(ak$load_policy("torch_default")$to_yaml())
  path <- withr::local_tempfile(fileext = ".yaml")
  writeLines(text, path)
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = path, net(x))), "bfloat16")
  writeLines(sub("lower_precision_dtype: bfloat16", "lower_precision_dtype: float16", text), path)
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = path, net(x))), "float16")
})

test_that("amp_trace() returns the casts of a region as a data.frame", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  x <- torch_randn(3, 4)
  tr <- amp_trace(with_autocast(device_type = "cpu", {
    y <- net(x)
  }))
  expect_s3_class(tr, "data.frame")
  expect_true(all(c("op", "rule", "device", "output_dtype") %in% names(tr)))
  row <- tr[tr$op == "linear", ]
  expect_equal(nrow(row), 1)
  expect_equal(row$rule, "lower_precision_fp")
  expect_equal(row$output_dtype, "bfloat16")
  expect_equal(dtype_name(y), "bfloat16")
  # nothing traced outside amp_trace()
  expect_equal(nrow(amp_trace(NULL)), 0)
})

test_that("amp_trace() of a loop lists the ops Python's trace of the same loop lists", {
  # Outputs R dropped are freed at the next call (release_tensors: detach_, set_): memory
  # housekeeping, which the trace listed as Tensor.detach_ rows Python's trace lacks.
  skip_if_no_ampkit()
  net <- nn_linear(8, 4)
  x <- torch_randn(2, 8)
  tr <- amp_trace(with_autocast(device_type = "cpu", {
    for (i in 1:5) {
      y <- net(x)
      z <- y$sum()
    }
  }))
  py <- reticulate::py_run_string("
def py_loop(net, x):
    import ampkit
    with ampkit.trace() as tr, ampkit.autocast('cpu'):
        for i in range(5):
            y = net(x)
            z = y.sum()
    return [r.op for r in tr.records]
", local = TRUE)
  expect_identical(tr$op, unlist(py$py_loop(net, x)))
  expect_false(any(grepl("detach_", tr$op)))
})

test_that("a Python exception in amp_trace()'s code is an ampkit_error and ends the trace", {
  skip_if_no_ampkit()
  net <- nn_linear(4, 2)
  err <- expect_error(amp_trace(with_autocast(device_type = "cpu", net(torch_randn(3, 5)))),
                      class = "ampkit_python_error")
  expect_s3_class(err, "ampkit_error")
  expect_match(conditionMessage(err), "^in an autocast region: Python raised RuntimeError: ")
  expect_false(is_autocast_enabled("cpu"))
  expect_equal(nrow(amp_trace(NULL)), 0)
})

test_that("the shipped fp8 policy runs linear in fp8 from R as it does from Python", {
  skip_if_no_ampkit()
  pt()$manual_seed(0L)
  net <- nn_linear(32, 16)
  x <- torch_randn(8, 32)
  tr <- amp_trace(y <- with_autocast(device_type = "cpu", policy = "fp8", net(x)))
  expect_equal(dtype_name(y), "bfloat16")
  row <- tr[tr$op == "linear", ]
  expect_equal(row$rule, "fp8")
  expect_equal(row$fp8_path, "emulated")
  expect_match(row$fp8_casts, "^input:float8_e4m3fn\\*.*, weight:float8_e4m3fn\\*")
  # the control: the same call through the Python core, and torch's own bf16 linear
  ns <- py_ns(paste(
    "import torch, ampkit",
    "def fp8(net, x):",
    "    with ampkit.autocast('cpu', policy='fp8'):",
    "        return net(x)",
    "def bf16(net, x):",
    "    with torch.autocast('cpu', dtype=torch.bfloat16):",
    "        return net(x)", sep = "\n"))
  expect_true(pt()$equal(y, ns$fp8(net, x)))
  expect_false(pt()$equal(y, ns$bf16(net, x)))
  tab <- as.data.frame(amp_policy("fp8"))
  expect_equal(tab$category[tab$op == "linear"], c("fp8", "fp8"))
  q <- amp_policy("torch_default", fp8 = "linear", device = "cpu")
  expect_equal(dtype_name(with_autocast(device_type = "cpu", policy = q, net(x))), "bfloat16")
  expect_true(pt()$equal(with_autocast(device_type = "cpu", policy = q, net(x)), y))
})
