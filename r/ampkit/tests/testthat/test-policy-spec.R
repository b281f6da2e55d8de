# Every CPU op of every shipped policy spec, read as data with the R yaml
# package: the dtype of its result in an R-driven autocast region is the one
# its category implies. The expectation comes from a control: the same call
# with its inputs cast by hand to the category's dtype, autocast off.
spec_files <- function() {
  Sys.glob(file.path(repo_dir(), "shared_specs", "policies", "*.yaml"))
}

spec_helpers_py <- "
import dataclasses, torch
from ampkit.testing import op_sample

def out_dtypes(out):
    if isinstance(out, torch.Tensor):
        return [str(out.dtype).replace('torch.', '')]
    if isinstance(out, (list, tuple)):
        return [d for o in out for d in out_dtypes(o)]
    return []

def cast_sample(s, dtype, first_only=False):
    done = []
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not (first_only and done):
            done.append(1)
            return t.to(dtype)
        return t
    def walk(a):
        return type(a)(walk(x) for x in a) if isinstance(a, (list, tuple)) else cast(a)
    return dataclasses.replace(s, args=tuple(walk(a) for a in s.args),
                               kwargs={k: walk(v) for k, v in s.kwargs.items()})

def n_floating(s):
    return len(s.tensors())
"

# Run `op` through an R-driven region (the policy's default dtype) and return
# its output dtypes, and those of the control.
check_op <- function(h, op, category, region) {
  torch <- pt()
  low <- torch[[region]]
  f32 <- torch$float32
  switch(category,
    lower_precision_fp = {
      s <- h$op_sample(op, "cpu", f32)
      got <- h$out_dtypes(with_autocast(device_type = "cpu", s()))
      want <- h$out_dtypes(h$cast_sample(s, low)())
      list(got = got, want = want, first = region)
    },
    fp32 = {
      s <- h$op_sample(op, "cpu", low)
      got <- h$out_dtypes(with_autocast(device_type = "cpu", s()))
      want <- h$out_dtypes(h$cast_sample(s, f32)())
      list(got = got, want = want, first = NULL)
    },
    fp32_output = {
      s <- h$op_sample(op, "cpu", low)
      got <- h$out_dtypes(with_autocast(device_type = "cpu", s()))
      list(got = got, want = rep("float32", length(got)), first = "float32")
    },
    promote = {
      # the first floating input in the region's dtype, the others in float32
      s <- h$cast_sample(h$op_sample(op, "cpu", f32), low, first_only = TRUE)
      if (h$n_floating(s) < 2) return(list(got = "one input", want = "at least two floating inputs"))
      got <- h$out_dtypes(with_autocast(device_type = "cpu", s()))
      list(got = got, want = h$out_dtypes(h$cast_sample(s, f32)()), first = "float32")
    }
  )
}

get_autocast_dtype_in <- function(policy, region) {
  with_autocast(device_type = "cpu", policy = policy, get_autocast_dtype("cpu"))
}

test_that("every CPU op of every policy spec gives the dtype its category implies", {
  skip_if_no_ampkit()
  skip_if_no_repo()
  files <- spec_files()
  expect_gt(length(files), 0)
  h <- py_golden(spec_helpers_py)
  # Where this CPU cannot run an op natively (oneDNN has no bf16 LSTM primitive on
  # AVX2-only CPUs), there is nothing to compare: the op is skipped, with the reason,
  # by the rule the Python tests and the drift check use.
  cannot_run <- unlist(reticulate::import("ampkit.drift")$ORACLE_CANNOT_RUN)
  unavailable <- character()
  for (f in files) {
    spec <- yaml::read_yaml(f)
    cpu <- spec$devices$cpu
    region <- cpu$lower_precision_dtype
    policy <- amp_policy(f)
    expect_equal(get_autocast_dtype_in(policy, region), region)
    for (category in c("lower_precision_fp", "fp32", "fp32_output", "promote")) {
      for (op in unlist(cpu[[category]])) {
        label <- sprintf("%s (%s, %s)", op, category, basename(f))
        r <- tryCatch(
          with_autocast(device_type = "cpu", policy = policy, check_op(h, op, category, region)),
          error = function(e) {
            if (!any(vapply(cannot_run, grepl, logical(1), conditionMessage(e), fixed = TRUE))) stop(e)
            NULL
          })
        if (is.null(r)) {
          unavailable <- c(unavailable, label)
          next
        }
        expect_gt(length(r$got), 0, label = label)
        expect_identical(r$got, r$want, label = label)
        if (!is.null(r$first)) expect_identical(r$got[[1]], r$first, label = label)
      }
    }
    for (op in names(cpu$banned)) {
      s <- h$op_sample(op, "cpu", pt()$float32)
      expect_error(with_autocast(device_type = "cpu", policy = policy, s()),
                   class = "ampkit_error", label = op)
      expect_false(is_autocast_enabled("cpu"))
    }
  }
  if (length(unavailable)) {
    skip(paste("native autocast cannot run on this CPU (no oracle) for:", paste(unavailable, collapse = "; ")))
  }
})

test_that("an op moved to banned from R raises an R condition and autocast is restored", {
  skip_if_no_ampkit()
  skip_if_no_repo()
  h <- py_golden(spec_helpers_py)
  p <- amp_policy("torch_default", banned = c(linear = "linear is banned here"), device = "cpu")
  s <- h$op_sample("linear", "cpu", pt()$float32)
  err <- expect_error(with_autocast(device_type = "cpu", policy = p, s()), class = "ampkit_error")
  expect_match(conditionMessage(err), "linear is banned here")
  expect_false(is_autocast_enabled("cpu"))
})
