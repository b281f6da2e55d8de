test_that("the package loads without Python and says what is missing on first use", {
  script <- paste(
    "library(ampkit)",
    "stopifnot(!ampkit_available())",
    "e <- tryCatch(with_autocast(device_type = 'cpu', 1), error = identity)",
    "cat(class(e), sep = '\\n'); cat(conditionMessage(e), '\\n')",
    sep = "; ")
  out <- suppressWarnings(system2(file.path(R.home("bin"), "Rscript"), c("-e", shQuote(script)),
    env = c(paste0("R_LIBS=", paste(.libPaths(), collapse = .Platform$path.sep)),
            "RETICULATE_PYTHON=/nonexistent/bin/python"),
    stdout = TRUE, stderr = TRUE))
  expect_true("ampkit_python_missing" %in% out)
  expect_true("ampkit_error" %in% out)
  expect_true(any(grepl("make setup", out)))
  expect_true(any(grepl("ampkit::install_ampkit(", out, fixed = TRUE)))
  expect_true(any(grepl("RETICULATE_PYTHON=/nonexistent/bin/python does not exist", out, fixed = TRUE)))
})

test_that("without RETICULATE_PYTHON the package uses the environment install_ampkit() makes", {
  skip_if_no_ampkit()
  root <- withr::local_tempdir()
  venv <- file.path(root, "r-ampkit")
  # A bare environment: loading picks it (and starts no Python); the first use runs it.
  made <- system2(reticulate::py_exe(), c("-m", "venv", "--copies", "--without-pip", shQuote(venv)), stdout = TRUE, stderr = TRUE)
  skip_if_not(file.exists(file.path(venv, "bin", "python")), paste("no venv:", paste(made, collapse = " ")))
  script <- paste(
    "Sys.unsetenv('RETICULATE_PYTHON')",
    "library(ampkit)",
    "stopifnot(!reticulate::py_available())",  # loading started no Python
    "invisible(ampkit_available())",
    "cat('python:', reticulate::py_config()$python, '\n')",
    sep = "; ")
  env <- c(paste0("R_LIBS=", paste(.libPaths(), collapse = .Platform$path.sep)),
           paste0("WORKON_HOME=", root))
  out <- suppressWarnings(system2(file.path(R.home("bin"), "Rscript"), c("-e", shQuote(script)),
                                  env = env, stdout = TRUE, stderr = TRUE))
  expect_true(any(grepl(paste("python:", file.path(venv, "bin", "python")), out, fixed = TRUE)),
              info = paste(out, collapse = "\n"))
})

test_that("ampkit_config() names the Python and the versions in use", {
  skip_if_no_ampkit()
  cfg <- ampkit_config()
  expect_equal(cfg$python, reticulate::py_exe())
  expect_equal(cfg$torch, pt()$`__version__`)
  expect_type(cfg$ampkit, "character")
  expect_type(cfg$cuda, "logical")
})

test_that("the embedded Python finds its C headers, which torch.compile's C++ includes", {
  skip_if_no_ampkit()
  # reticulate points a venv's sys.base_prefix at the venv, whose include folder has no
  # Python.h; the start-up puts the interpreter's INCLUDEPY on CPATH, which the compiler reads.
  found <- py_golden(paste(
    "import os, sysconfig",
    "dirs = [sysconfig.get_path('include')] + os.environ.get('CPATH', '').split(os.pathsep)",
    "found = any(d and os.path.exists(os.path.join(d, 'Python.h')) for d in dirs)",
    "has_headers = os.path.exists(os.path.join(sysconfig.get_config_var('INCLUDEPY') or '', 'Python.h'))",
    sep = "\n"))
  skip_if_not(found$has_headers, "this Python was installed without its C headers")
  expect_true(found$found)
})

test_that("torch is loaded with its own BLAS, not R's (RTLD_DEEPBIND before the first import)", {
  skip_if_no_ampkit()
  skip_if(Sys.getenv("AMPKIT_R_DEEPBIND") == "0", "AMPKIT_R_DEEPBIND=0 turns it off")
  skip_if_not(reticulate::py_eval("hasattr(__import__('os'), 'RTLD_DEEPBIND')"), "no RTLD_DEEPBIND here")
  # R's reference BLAS is loaded before Python starts; without the flag torch's float32
  # matmuls bind to its sgemm (15-20x slower on the CPU).
  flags <- reticulate::py_eval("__import__('sys').getdlopenflags() & __import__('os').RTLD_DEEPBIND")
  expect_true(flags > 0)
})
