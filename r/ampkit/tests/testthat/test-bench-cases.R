# Every case of shared_specs/benchmarks runs from R at its smallest profile,
# through the bench runner benchmarks/run.R (which drives with_autocast(),
# amp_grad_scaler() and amp_train_step()), and ends on the loss that the
# Python runner reaches on the same seeded model and data.
smallest_profile <- function(spec) {
  cost <- vapply(spec$profiles, function(p) prod(unlist(p$sizes)) * p$num_batches, numeric(1))
  names(spec$profiles)[[which.min(cost)]]
}

test_that("every benchmark case runs at its smallest size from R and matches the Python runner", {
  skip_if_no_ampkit()
  skip_if_no_repo()
  runner <- file.path(repo_dir(), "benchmarks", "run.R")
  skip_if_not(file.exists(runner), "benchmarks/run.R (the bench runner) is not there yet")
  files <- Sys.glob(file.path(repo_dir(), "shared_specs", "benchmarks", "*.yaml"))
  skip_if(length(files) == 0, "no benchmark cases in shared_specs/benchmarks")
  specs <- lapply(files, yaml::read_yaml)
  names(specs) <- vapply(specs, function(s) s$name, "")
  profiles <- vapply(specs, smallest_profile, "")
  # ampkit_amp: with_autocast() + amp_grad_scaler(); amp_train_step() has its own test
  variants <- "ampkit_amp"
  bench <- reticulate::import("ampkit.bench")
  all_variants <- bench$load_variants()

  for (profile in unique(profiles)) {
    cases <- names(profiles)[profiles == profile]
    out <- tempfile(fileext = ".json")
    env <- c(paste0("R_LIBS=", paste(.libPaths(), collapse = .Platform$path.sep)),
             paste0("RETICULATE_PYTHON=", reticulate::py_exe()), "OMP_NUM_THREADS=1")
    log <- suppressWarnings(system2(file.path(R.home("bin"), "Rscript"),
      c(shQuote(runner), "--profile", profile, "--device", "cpu", "--threads", "1",
        "--repeats", "1", "--cases", paste(cases, collapse = ","),
        "--variants", paste(variants, collapse = ","), "--out", shQuote(out)),
      env = env, stdout = TRUE, stderr = TRUE))
    expect_true(file.exists(out), label = paste(c("run.R wrote its results:", log), collapse = "\n"))
    if (!file.exists(out)) next
    doc <- jsonlite::fromJSON(out, simplifyVector = FALSE)
    for (case in cases) {
      for (v in variants) {
        rec <- Filter(function(r) r$case == case && r$variant == v, doc$records)
        label <- sprintf("%s / %s at %s", case, v, profile)
        expect_length(rec, 1)
        rec <- rec[[1]]
        expect_identical(rec$language, "r")
        expect_identical(rec$status, "ok", label = paste(label, rec$error))
        expect_true(is.finite(rec$final_loss), label = label)
        # the same case and variant driven by the Python runner
        built <- bench$build_case(case, profile, seed = 0L, device = "cpu", repeats = 1L)
        py <- bench$run_variant(built, all_variants[[v]])
        expect_identical(rec$final_loss, py$final_loss, label = label)
      }
    }
  }
})
