# ampkit_available() answers FALSE without an error; these check that it then says why.

# Run `script` in a fresh R whose reticulate is pointed at `python`; its output lines.
rscript_with_python <- function(script, python) {
  suppressWarnings(system2(file.path(R.home("bin"), "Rscript"), c("-e", shQuote(script)),
    env = c(paste0("R_LIBS=", paste(.libPaths(), collapse = .Platform$path.sep)),
            paste0("RETICULATE_PYTHON=", python)),
    stdout = TRUE, stderr = TRUE))
}

test_that("ampkit_available() is FALSE and names the Python it found when that Python has no torch", {
  skip_if_no_ampkit()
  # A bare environment of the same Python: it starts, but has neither torch nor ampkit.
  venv <- file.path(withr::local_tempdir(), "bare")
  made <- system2(reticulate::py_exe(), c("-m", "venv", "--without-pip", shQuote(venv)), stdout = TRUE, stderr = TRUE)
  bare <- file.path(venv, "bin", "python")
  skip_if_not(file.exists(bare), paste("no venv:", paste(made, collapse = " ")))
  out <- rscript_with_python("library(ampkit); cat('available:', ampkit_available(), '\\n')", bare)
  text <- paste(out, collapse = "\n")
  expect_true("available: FALSE " %in% out, info = text)
  expect_match(text, paste0("reticulate found the Python at ", bare, ", which has no `torch`"), fixed = TRUE)
  expect_match(text, "Sys.setenv(RETICULATE_PYTHON = ", fixed = TRUE)
  expect_match(text, "reticulate::use_python(", fixed = TRUE)
  expect_match(text, "ampkit::install_ampkit(", fixed = TRUE)
})

test_that("ampkit_available() says that a RETICULATE_PYTHON which does not exist is the cause", {
  out <- rscript_with_python("library(ampkit); cat('available:', ampkit_available(), '\\n')",
                             "/nonexistent/bin/python")
  text <- paste(out, collapse = "\n")
  expect_true("available: FALSE " %in% out, info = text)
  expect_match(text, "RETICULATE_PYTHON=/nonexistent/bin/python does not exist", fixed = TRUE)
  expect_match(text, "reticulate::use_python(", fixed = TRUE)
})

test_that("ampkit_available() is TRUE without a message when Python, torch and ampkit load", {
  skip_if_no_ampkit()
  expect_message(ok <- ampkit_available(), NA)
  expect_true(ok)
})
